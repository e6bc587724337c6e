"""The dataset report as one self-contained HTML page: tables, and plots drawn with Pillow as PNG
data URIs (no matplotlib, no files beside the page, nothing fetched when it is opened)."""

import base64
import html
import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 60, 16, 28, 44  # plot margins in pixels
BAR, MARKER, AXIS = (70, 110, 180), (200, 40, 40), (60, 60, 60)
MARKER_COLORS = ((200, 40, 40), (230, 140, 0), (40, 150, 60))


def _font(size: int = 12):
    return ImageFont.load_default(size=size)


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _label(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"


def histogram(values, title: str, bins: int = 40, markers=(), log: bool = False) -> str:
    """A histogram PNG (data URI) of `values`; `markers`: [(x, label)] drawn as vertical lines
    (thresholds, token limits) and kept inside the x range."""
    values = np.asarray(values, dtype=np.float64)
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    draw.text((LEFT, 6), title, fill=AXIS, font=_font(14))
    x0, y0, x1, y1 = LEFT, TOP, WIDTH - RIGHT, HEIGHT - BOTTOM
    draw.line([(x0, y0), (x0, y1), (x1, y1)], fill=AXIS)
    if values.size == 0:
        draw.text((x0 + 10, y0 + 10), "no values", fill=AXIS, font=_font())
        return _png(image)
    points = [values.min(), values.max(), *(x for x, _ in markers)]
    low, high = min(points), max(points)
    if low == high:
        low, high = low - 0.5, high + 0.5
    counts, edges = np.histogram(values, bins=bins, range=(low, high))
    top = max(1, counts.max())
    scale = (lambda c: math.log1p(c) / math.log1p(top)) if log else (lambda c: c / top)

    def x_of(value):
        return x0 + (value - low) / (high - low) * (x1 - x0)

    for count, left, right in zip(counts, edges[:-1], edges[1:]):
        if count:
            height = max(1, scale(count) * (y1 - y0))
            draw.rectangle(
                [x_of(left) + 1, y1 - height, max(x_of(left) + 1, x_of(right) - 1), y1], fill=BAR
            )
    for tick in np.linspace(low, high, 5):
        draw.line([(x_of(tick), y1), (x_of(tick), y1 + 4)], fill=AXIS)
        draw.text((x_of(tick), y1 + 6), _label(tick), fill=AXIS, font=_font(), anchor="ma")
    draw.text((x0 - 6, y0), str(int(top)), fill=AXIS, font=_font(), anchor="ra")
    draw.text((x0 - 6, y1), "0", fill=AXIS, font=_font(), anchor="rb")
    if log:
        draw.text((x0 - 6, y0 + 14), "(log)", fill=AXIS, font=_font(10), anchor="ra")
    for (x, label), color in zip(markers, MARKER_COLORS * 4):
        draw.line([(x_of(x), y0), (x_of(x), y1)], fill=color, width=2)
        draw.text((x_of(x) + 3, y0 + 2), label, fill=color, font=_font())
    return _png(image)


def bars(labels, counts, title: str, limit: int = 40) -> str:
    """Horizontal bars (data URI PNG) for categories: buckets, modes."""
    labels, counts = list(labels)[:limit], list(counts)[:limit]
    row = 16
    height = TOP + row * max(1, len(labels)) + 10
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((LEFT, 6), title, fill=AXIS, font=_font(14))
    top = max([1, *counts])
    x0, x1 = 130, WIDTH - 70
    for i, (label, count) in enumerate(zip(labels, counts)):
        y = TOP + i * row
        draw.text((x0 - 6, y + 1), str(label), fill=AXIS, font=_font(), anchor="ra")
        draw.rectangle([x0, y + 2, x0 + max(1, count / top * (x1 - x0)), y + row - 2], fill=BAR)
        draw.text((x0 + count / top * (x1 - x0) + 4, y + 1), str(count), fill=AXIS, font=_font())
    return _png(image)


def _table(rows, header=None) -> str:
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    head = (
        "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    )
    return f"<table>{head}{cells}</table>"


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{html.escape(alt)}">'


def _counts_section(counts) -> str:
    if counts is None:
        return "<p>This dataset type keeps no counts of its filters.</p>"
    rows = [("found", counts["found"], "")]
    for reason, n in counts["dropped"].items():
        rows.append((f"dropped: {reason}", n, ", ".join(counts["examples"].get(reason, [])[:3])))
    rows.append(("indexed", counts["indexed"], ""))
    rows.append(("usable", counts["usable"], ""))
    for problem, n in counts["noted"].items():
        rows.append((f"kept with {problem}", n, ", ".join(counts["examples"].get(problem, [])[:3])))
    if "unreadable_at_load" in counts:
        examples = ", ".join(counts["examples"].get("unreadable at load", [])[:3])
        rows.append(("unreadable at load (decoded)", counts["unreadable_at_load"], examples))
    return "<h3>Counts</h3>" + _table(rows, ("", "items", "first files"))


def _captions_section(captions) -> str:
    parts = ["<h3>Captions</h3>"]
    parts.append(
        f"<p>{captions['count']} captions, {captions['empty']} empty; not clean UTF-8: "
        f"{html.escape(str(captions['not_clean_utf8'] or 'none'))}</p>"
    )
    for tokens in captions["tokens"]:
        if "error" in tokens:
            parts.append(f"<p>{html.escape(tokens['encoder'])}: {html.escape(tokens['error'])}</p>")
            continue
        limit = tokens["max_length"]
        title = f"tokens per caption, {tokens['encoder']}: {tokens['truncated']} over {limit}"
        parts.append(
            _img(histogram(tokens["lengths"], title, markers=[(limit, str(limit))]), title)
        )
    if not captions["tokens"]:
        parts.append("<p>The model config names no CLIP or T5 text encoder: no token counts.</p>")
    parts.append(_table(captions["top_words"], ("tag / word", "captions")))
    return "".join(parts)


def _scores_section(scores) -> str:
    raw_markers = (
        [(scores["abs_min_score"], "abs_min_score")] if scores["abs_min_score"] is not None else []
    )
    bonus_markers = [(scores["min_score"], "min_score")] if scores["min_score"] is not None else []
    return (
        "<h3>Scores</h3>"
        + _img(histogram(scores["raw"], "score before tag bonuses", markers=raw_markers), "raw")
        + _img(
            histogram(scores["with_bonus"], "score after tag bonuses", markers=bonus_markers),
            "with bonuses",
        )
        + f"<p>tag_bonus_scores: {html.escape(str(scores['tag_bonus_scores'] or 'none'))}</p>"
    )


def _buckets_section(buckets) -> str:
    labels = [f"{b['size'][0]}x{b['size'][1]}" if b["size"] else "all" for b in buckets["buckets"]]
    counts = [b["images"] for b in buckets["buckets"]]
    ranks = [(r["rank"], r["steps"], r["images"]) for r in buckets["ranks"]]
    small = ", ".join(
        f"{b['size'][0]}x{b['size'][1]} ({b['images']})" if b["size"] else str(b["images"])
        for b in buckets["smaller_than_batch"]
    )
    return (
        "<h3>Buckets</h3>"
        + _img(bars(labels, counts, "images per bucket"), "buckets")
        + f"<p>Smaller than a batch of {buckets['batch_size']}: {html.escape(small or 'none')}. "
        f"On {buckets['world_size']} rank(s) an epoch drops {buckets['dropped']} images and serves "
        f"{buckets['repeated']} twice to fill batches and ranks.</p>"
        + _table(ranks, ("rank", "steps per epoch", "images per epoch"))
    )


def _images_section(images) -> str:
    widths, heights = np.array(images["widths"]), np.array(images["heights"])
    aspect = widths / np.maximum(heights, 1) if widths.size else widths
    parts = [
        "<h3>Images</h3>",
        f"<p>{images['decoded']} decoded, median {images['decode_ms_median']:.1f} ms each; "
        f"{len(images['unreadable'])} unreadable.</p>",
        _img(histogram(widths, "width (pixels)"), "widths"),
        _img(histogram(heights, "height (pixels)"), "heights"),
        _img(histogram(aspect, "aspect ratio (width / height)", markers=[(1.0, "1:1")]), "aspect"),
        _img(bars(list(images["modes"]), list(images["modes"].values()), "modes"), "modes"),
        "<h4>Slowest decodes</h4>",
        _table([(r["path"], f"{r['ms']:.1f} ms") for r in images["slowest"]], ("file", "decode")),
        "<h4>Unreadable</h4>",
        _table([(r["path"], r["error"]) for r in images["unreadable"][:20]], ("file", "error")),
    ]
    for key, title in (
        ("exact_duplicates", "Exact duplicates"),
        ("near_duplicates", "Near duplicates (dHash)"),
    ):
        groups = images[key]
        parts.append(f"<h4>{title}: {len(groups)} groups, {sum(map(len, groups))} files</h4>")
        parts.append(_table([(len(g), ", ".join(g[:6])) for g in groups[:20]], ("files", "paths")))
    return "".join(parts)


STYLE = """body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse;
margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:90%}
img{display:block;margin:.5em 0}"""


def render(report: dict) -> str:
    """The page's HTML text."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>dataset report</title>"
        f"<style>{STYLE}</style></head><body><h1>Dataset report</h1>"
        f"<p>{html.escape(report.get('config', ''))} ({report.get('seconds', 0):.1f} s"
        f"{', images decoded' if report['decode'] else ', metadata only'})</p>"
    ]
    for split in report["splits"]:
        parts.append(
            f"<h2>{html.escape(split['name'])} ({split['type']}, {split['items']} items)</h2>"
        )
        parts += [f"<p><em>{html.escape(note)}</em></p>" for note in split["notes"]]
        parts.append(_counts_section(split["counts"]))
        if split.get("captions"):
            parts.append(_captions_section(split["captions"]))
        if split.get("scores"):
            parts.append(_scores_section(split["scores"]))
        parts.append(_buckets_section(split["buckets"]))
        if split.get("images"):
            parts.append(_images_section(split["images"]))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: dict, path) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(render(report))
