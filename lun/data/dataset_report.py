"""Know your data before you train: what a config's datasets will actually train on.

    python scripts/inspect_data.py --base configs/my.yaml [key=value ...] [--decode] [--out DIR]
    python main.py --inspect --base configs/my.yaml ...          (the same)

The datasets are built exactly as training builds them (same config merge, same classes), and
the report prints their decisions - it applies no rule of its own: how many items each rule
dropped (`Local.counts`, filled where the rules run), the captions the loader would hand out
(`dataset.caption`), their token lengths under the model's own text-encoder tokenizers, the
scores before and after tag bonuses against the thresholds, the buckets and what the bucket
sampler (lun.data.buckets.BucketBatchSampler) makes of them for a world size, and - with
`--decode` - each image decoded by the dataset's own decoder: sizes, modes, slow files, exact
and near duplicates. A terminal summary, `report.html` (plots embedded) and `report.json` are
written under `--out` (default `reports/<time>_<config>/`, not a run folder).
"""

import argparse
import hashlib
import html
import io
import json
import logging
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import numpy as np
from PIL import Image

from lun.config import config_nodes
from lun.data.counts import count_lines
from lun.data.dataset_report_sd3 import sd3_encoders

TOP_WORDS = 30  # most common tags / words listed
SLOWEST = 10  # slowest decodes listed
GROUPS_LISTED = 20  # duplicate groups listed in full
NEAR_DUPLICATE_BITS = 3  # dHash Hamming distance (of 64 bits) that still counts as a duplicate
DECODE_THREADS = 4  # Pillow releases the GIL while decoding: threads overlap decodes and reads
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")


# ------------------------------------------------------------------------------------- counts


def _counts(dataset) -> dict | None:
    counts = getattr(dataset, "counts", None)
    if counts is None:
        return None
    examples = getattr(getattr(dataset, "bad_input", None), "examples", {})
    return {
        "found": counts["found"],
        "dropped": dict(counts["dropped"]),
        "indexed": counts["indexed"],
        "usable": counts["usable"],
        "noted": dict(counts["noted"]),
        "examples": {reason: list(paths) for reason, paths in examples.items()},
    }


# ----------------------------------------------------------------------------------- captions


def text_encoders(model_config) -> list[dict]:
    """{name, tokenizer, max_length, unescape} of every CLIP / OpenCLIP text encoder in the model
    config (SDXL has two), with the tokenizer that encoder itself would build - nothing built."""
    from ldm.text_encoder import clip_tokenizer, tokenizer_of
    from ldm.util import get_obj_from_str

    found = []
    for key, node in config_nodes(model_config):
        try:
            cls = get_obj_from_str(node["target"]) if isinstance(node.get("target"), str) else None
        except (ImportError, ValueError):
            continue
        params = node.get("params") or {}
        tokenizer = tokenizer_of(cls, params)
        if tokenizer is None:
            continue
        folder, unescape = tokenizer
        try:
            tokenizer, error = clip_tokenizer(folder), None
        except (FileNotFoundError, OSError) as err:  # no vocabulary here: say so, go on
            tokenizer, error = None, str(err).splitlines()[0]
        found.append(
            {
                "name": f"{key} ({cls.__name__})",
                "tokenizer": tokenizer,
                "error": error,
                "max_length": int(params.get("max_length", 77)),
                "unescape": unescape,
            }
        )
    return found


def caption_words(caption: str, separator: str | None) -> list[str]:
    """Tags (metadata mode: split by its tag_separator; else by commas when the caption has
    them), or lower-case words."""
    separator = separator or ("," if "," in caption else None)
    if separator is None:
        return caption.lower().split()
    return [t.strip() for t in caption.split(separator.strip() or separator) if t.strip()]


def caption_report(dataset, encoders: list[dict], progress) -> dict:
    """Every usable item's caption as the loader makes it: empty ones, those that were not clean
    UTF-8 (the dataset's own notes), the common tags / words and per-encoder token lengths."""
    from lun.data.report import LOAD_NOTES

    metadata = getattr(dataset, "metadata", None)
    separator = metadata.tag_separator if metadata is not None else None
    captions, words = [], Counter()
    for index in progress(range(len(dataset)), desc="captions"):
        caption = dataset.caption(index)
        captions.append(caption)
        words.update(caption_words(caption, separator))
    noted = getattr(getattr(dataset, "bad_input", None), "noted", None)
    undecodable = {}
    if noted is not None:
        undecodable = {note: int((noted == c).sum()) for c, note in enumerate(LOAD_NOTES, 1)}
    report = {
        "count": len(captions),
        "empty": sum(1 for c in captions if not c.strip()),
        "not_clean_utf8": {k: v for k, v in undecodable.items() if v},
        "top_words": words.most_common(TOP_WORDS),
        "tokens": [],
    }
    unique = sorted(set(captions))  # tag captions repeat rarely, plain ones (or "") often
    for encoder in encoders:
        if encoder["tokenizer"] is None:
            report["tokens"].append({"encoder": encoder["name"], "error": encoder["error"]})
            continue
        texts = [html.unescape(html.unescape(t)) for t in unique] if encoder["unescape"] else unique
        lengths = {}
        for start in progress(range(0, len(texts), 1024), desc=f"tokens {encoder['name']}"):
            chunk = texts[start : start + 1024]
            ids = encoder["tokenizer"](chunk, truncation=False, verbose=False)["input_ids"]
            lengths.update(zip(unique[start : start + 1024], map(len, ids)))
        per_item = np.array([lengths[c] for c in captions], dtype=np.int64)
        report["tokens"].append(
            {
                "encoder": encoder["name"],
                "max_length": encoder["max_length"],
                "lengths": per_item.tolist(),  # with <sot> and <eot>, as the encoder counts
                "truncated": int((per_item > encoder["max_length"]).sum()),
            }
        )
    return report


# ------------------------------------------------------------------------------------- scores


def score_report(dataset) -> dict | None:
    """Raw and bonus-added scores of every indexed item (metadata mode), with the thresholds."""
    scores = getattr(dataset, "scores", None)
    if scores is None:
        return None
    raw, with_bonus = scores
    params = dataset.metadata
    return {
        "raw": raw.tolist(),
        "with_bonus": with_bonus.tolist(),
        "abs_min_score": params.abs_min_score,
        "min_score": params.min_score,
        "tag_bonus_scores": dict(params.tag_bonus_scores),
    }


# ------------------------------------------------------------------------------------ buckets


def bucket_report(dataset, batch_size: int, world_size: int, seed: int, train=True) -> dict:
    """Images per bucket, the buckets smaller than a batch, and what the split's sampler (the
    DataModule's: shuffled for training, in order otherwise) makes of them on `world_size`
    ranks: steps per epoch per rank, the items no rank sees in an epoch (dropped) and those
    served twice to fill batches and ranks (repeated)."""
    from lun.data.buckets import BucketBatchSampler

    groups = getattr(dataset, "batch_groups", None)
    groups = np.zeros(len(dataset), dtype=np.int64) if groups is None else np.asarray(groups)
    sizes = getattr(dataset, "bucket_sizes", None) or [None]
    per_bucket = np.bincount(groups, minlength=len(sizes))
    ranks, served = [], Counter()
    for rank in range(world_size):
        sampler = BucketBatchSampler(
            groups, batch_size, shuffle=train, seed=seed, rank=rank, world_size=world_size
        )
        items = [i for _, batch in sampler.numbered() for i in batch]
        served.update(items)
        ranks.append({"rank": rank, "steps": len(sampler), "images": len(items)})
    buckets = [
        {"size": list(size) if size else None, "images": int(n)}
        for size, n in zip(sizes, per_bucket)
    ]
    return {
        "batch_size": batch_size,
        "world_size": world_size,
        "buckets": buckets,
        "smaller_than_batch": [b for b in buckets if 0 < b["images"] < batch_size],
        "ranks": ranks,
        "dropped": len(dataset) - len(served),
        "repeated": sum(served.values()) - len(served),
    }


# ------------------------------------------------------------------------------------- images


def dhash(image: Image.Image) -> int:
    """64-bit difference hash (N. Krawetz, "Kind of Like That", hackerfactor.com 2013): the
    image shrunk to 9x8 grey pixels, one bit per horizontal neighbour pair (left brighter).
    Resizing, recompression and small edits keep most bits; unrelated images differ in ~32."""
    grey = np.asarray(image.convert("L").resize((9, 8), Image.Resampling.BILINEAR), np.int16)
    bits = (grey[:, :-1] > grey[:, 1:]).flatten()  # (64,)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def near_duplicate_groups(hashes: list[int], max_bits: int = NEAR_DUPLICATE_BITS) -> list[list]:
    """Groups (indices into `hashes`) of items whose hash is within `max_bits` bits of their
    group's first item.

    Leader clustering, not connected components: a chain of small steps (a gradient of similar
    images) must not merge into one huge group. Identical hashes are grouped first; among the
    distinct ones, pigeonhole keeps the search near-linear - two 64-bit hashes within 3 bits
    agree on at least one of their four 16-bit quarters, so only hashes sharing a quarter at the
    same place are compared (all pairs of each such bucket at once)."""
    assert max_bits < 4, "the 4-band candidate search finds pairs within 3 bits"
    distinct, first, item_of = np.unique(
        np.array(hashes, dtype=np.uint64), return_index=True, return_inverse=True
    )
    neighbours = {}  # distinct index -> distinct indices within max_bits
    for band in range(4):
        keys = (distinct >> np.uint64(16 * band)) & np.uint64(0xFFFF)
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        # Pairs k positions apart in the sorted order that share the key, all k at once.
        for k in range(1, len(order)):
            same = np.flatnonzero(keys[:-k] == keys[k:])
            if not same.size:
                break
            a, b = order[same], order[same + k]
            close = np.bitwise_count(distinct[a] ^ distinct[b]) <= max_bits
            for i, j in zip(a[close].tolist(), b[close].tolist()):
                neighbours.setdefault(i, set()).add(j)
                neighbours.setdefault(j, set()).add(i)
    leader = {}
    for i in sorted(neighbours, key=lambda d: first[d]):  # leaders in the order items come
        if i not in leader:
            leader[i] = i
            leader.update({j: i for j in neighbours[i] if j not in leader})
    groups = {}
    for item, value in enumerate(item_of.ravel()):
        groups.setdefault(leader.get(int(value), int(value)), []).append(item)
    return sorted((g for g in groups.values() if len(g) > 1), key=len, reverse=True)


def _decode_one(dataset, index: int) -> dict:
    """One item through the dataset's own decoder (what the loader does), timed, plus what the
    header says before conversion to RGB (size, mode) and the file's hash."""
    from lun.data.images import ImageError, decode_image, image_size

    path = os.path.join(dataset.data_root, dataset.image_name(index))
    try:
        with open(path, "rb") as file:
            data = file.read()
        start = time.perf_counter()
        image = decode_image(io.BytesIO(data), dataset.item_size(index), dataset.max_image_pixels)
        seconds = time.perf_counter() - start
        with Image.open(io.BytesIO(data)) as header:
            mode = header.mode
        width, height = image_size(io.BytesIO(data), dataset.max_image_pixels)
    except (ImageError, OSError) as err:
        dataset.bad_input.load_failed(index, path, err)  # the dataset's own bookkeeping
        return {"index": index, "path": path, "error": str(err)}
    return {
        "index": index,
        "path": path,
        "width": width,
        "height": height,
        "mode": "16-bit" if mode in SIXTEEN_BIT else mode,
        "seconds": seconds,
        "sha256": hashlib.sha256(data).hexdigest(),
        "dhash": dhash(image),
    }


def image_report(dataset, progress) -> dict:
    """Decode every usable item: sizes, aspects, modes, slow decodes, duplicates."""
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        jobs = pool.map(lambda i: _decode_one(dataset, i), range(len(dataset)))
        results = list(progress(jobs, total=len(dataset), desc="decode"))
    good = [r for r in results if "error" not in r]
    by_sha = {}
    for r in good:
        by_sha.setdefault(r["sha256"], []).append(r["path"])
    exact = sorted((g for g in by_sha.values() if len(g) > 1), key=len, reverse=True)
    near = [[good[i]["path"] for i in g] for g in near_duplicate_groups([r["dhash"] for r in good])]
    seconds = np.array([r["seconds"] for r in good]) if good else np.zeros(0)
    slowest = sorted(good, key=lambda r: r["seconds"], reverse=True)[:SLOWEST]
    return {
        "decoded": len(good),
        "unreadable": [{"path": r["path"], "error": r["error"]} for r in results if "error" in r],
        "widths": [r["width"] for r in good],
        "heights": [r["height"] for r in good],
        "modes": dict(Counter(r["mode"] for r in good).most_common()),
        "decode_ms_median": float(np.median(seconds) * 1e3) if len(seconds) else 0.0,
        "slowest": [{"path": r["path"], "ms": r["seconds"] * 1e3} for r in slowest],
        "exact_duplicates": exact,
        "near_duplicates": near,
    }


# ------------------------------------------------------------------------------------- report


def inspect_split(name, dataset, *, batch_size, world_size, seed, encoders, decode, progress):
    """The report of one dataset (a split of the DataModule)."""
    kind = type(dataset).__name__
    report = {"name": name, "type": kind, "items": len(dataset), "notes": []}
    report["counts"] = _counts(dataset)
    local = hasattr(dataset, "image_name") and report["counts"] is not None
    if not local:  # what the report reads is lun.data.local.Local's
        report["notes"].append(f"{kind} keeps no per-rule counts, captions or image list")
    if decode and local:
        report["images"] = image_report(dataset, progress)
        report["counts"] = _counts(dataset)  # with the items that failed to decode
        failed = dataset.bad_input.failed
        report["counts"]["unreadable_at_load"] = int(failed.sum()) if failed is not None else 0
        report["items"] = report["images"]["decoded"]  # the headline: what training can read
    if local:
        report["captions"] = caption_report(dataset, encoders, progress)
    report["scores"] = score_report(dataset)
    train = name == "data.train"
    report["buckets"] = bucket_report(dataset, batch_size, world_size, seed, train)
    return report


def summary(report: dict) -> str:
    """The terminal summary: counts, captions, scores, buckets, images."""
    lines = [f"dataset report of {report['config']}"]
    for split in report["splits"]:
        name = split["name"]
        head = f"\n{name} ({split['type']}): {split['items']} usable items"
        undecodable = len((split.get("images") or {}).get("unreadable", []))
        if undecodable:  # --decode read them all: the index's count less what failed
            head += f" ({undecodable} of the {split['items'] + undecodable} indexed could not be decoded)"
        lines.append(head)
        lines += [f"  note: {note}" for note in split["notes"]]
        counts = split["counts"]
        if counts is not None:
            lines += ["  " + line.split(": ", 1)[1] for line in count_lines(name, counts)]
            if counts.get("unreadable_at_load"):
                lines.append(f"  unreadable at load (--decode): {counts['unreadable_at_load']}")
            for reason, paths in counts["examples"].items():
                lines.append(f"    {reason}, e.g. {', '.join(paths[:3])}")
        captions = split.get("captions")
        if captions:
            lines.append(
                f"  captions: {captions['empty']} empty, not clean UTF-8: "
                f"{captions['not_clean_utf8'] or 'none'}"
            )
            for tokens in captions["tokens"]:
                if "error" in tokens:
                    lines.append(f"  tokens {tokens['encoder']}: no tokenizer ({tokens['error']})")
                    continue
                lengths = np.array(tokens["lengths"] or [0])
                lines.append(
                    f"  tokens {tokens['encoder']}: median {int(np.median(lengths))}, max "
                    f"{lengths.max()}, {tokens['truncated']} over {tokens['max_length']} (truncated)"
                )
            top = ", ".join(f"{w} ({n})" for w, n in captions["top_words"][:10])
            lines.append(f"  top tags/words: {top}")
        scores = split.get("scores")
        if scores:
            raw, bonus = np.array(scores["raw"] or [0]), np.array(scores["with_bonus"] or [0])
            lines.append(
                f"  scores: raw {raw.min():g}..{raw.max():g} (abs_min_score "
                f"{scores['abs_min_score']}), with bonuses {bonus.min():g}..{bonus.max():g} "
                f"(min_score {scores['min_score']})"
            )
        buckets = split["buckets"]
        small = len(buckets["smaller_than_batch"])
        steps = ", ".join(str(r["steps"]) for r in buckets["ranks"])
        lines.append(
            f"  buckets: {len(buckets['buckets'])} ({small} smaller than a batch of "
            f"{buckets['batch_size']}); steps per epoch per rank on {buckets['world_size']}: "
            f"{steps}; dropped {buckets['dropped']}, repeated {buckets['repeated']} to fill"
        )
        images = split.get("images")
        if images:
            lines.append(
                f"  images: {images['decoded']} decoded (median {images['decode_ms_median']:.1f} "
                f"ms), {len(images['unreadable'])} unreadable, modes {images['modes']}, "
                f"{len(images['exact_duplicates'])} exact and {len(images['near_duplicates'])} "
                "near-duplicate groups"
            )
    return "\n".join(lines)


def build_report(config: dict, *, decode=False, world_size=None, seed=23, progress=None) -> dict:
    """The report of every split of `config["data"]`, built the way main.py builds them."""
    from lightning.pytorch import seed_everything
    from tqdm import tqdm

    from lun.data.datamodule import DataModule
    from lun.trainer import build_data

    progress = progress or (lambda it, **kw: tqdm(it, file=sys.stderr, leave=False, **kw))
    seed_everything(seed, workers=True)  # the tag-shuffle seed training would use
    data = build_data(config["data"])
    if not isinstance(data, DataModule):
        raise ValueError(f"data.target: the report reads lun.data.DataModule, not {type(data)}")
    trainer = (config.get("lightning") or {}).get("trainer") or {}
    if world_size is None:
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        world_size = (devices if isinstance(devices, int) and devices > 0 else 1) * nodes
    model = config.get("model") or {}
    encoders = text_encoders(model) + sd3_encoders(model)  # SD3: CLIP-L, bigG (77), T5 (256)
    splits = []
    for split, dataset in data.datasets.items():
        dataset = getattr(dataset, "dataset", dataset)  # the images under a latent cache
        splits.append(
            inspect_split(
                f"data.{split}",
                dataset,
                batch_size=data.batch_size(split),
                world_size=world_size,
                seed=data.seed if data.seed is not None else seed,
                encoders=encoders,
                decode=decode,
                progress=progress,
            )
        )
    return {"decode": decode, "splits": splits}


def data_config(cfg) -> dict:
    """The merged config as a dict, complete where the report reads it: its `data` (checked as
    main.py checks the whole), while the model may keep required values unset (`ckpt_path: ???`
    does not matter to a report on the data)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lun.config import ConfigError, check_complete

    missing = [key for key in OmegaConf.missing_keys(cfg) if key.startswith("data.")]
    if missing:
        check_complete(OmegaConf.masked_copy(cfg, ["data"]))  # its one-line error
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve config: {str(err).splitlines()[0]}") from None


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
    from lun.cli import HelpFormatter, old_spelling

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-b", "--base", nargs="*", default=[], metavar="config.yaml")
    parser.add_argument("--decode", action="store_true", help="decode every image (slower)")
    parser.add_argument("--out", help="report folder (default reports/<time>_<config>)")
    parser.add_argument("--world-size", type=int, help="ranks (default: the trainer's devices)")
    parser.add_argument("-s", "--seed", type=int, default=23, help="main.py's seed")
    parser.add_argument("--data-root", help="as main.py's: the train (and validation) data_root")
    old_spelling(parser, "--data_root", "data_root")
    opt, dotlist = parser.parse_known_args(argv)
    overrides = [a for a in opt.base if "=" in a or a.startswith("~")]
    opt.base = [a for a in opt.base if a not in overrides]
    return opt, overrides + dotlist


def main(argv=None) -> int:
    """Command line: config merge as main.py, one-line errors with exit status 2."""
    from lun.config import ConfigError, merge_configs, set_data_root, translate_legacy_keys
    from lun.data.dataset_report_html import write_html

    opt, dotlist = parse_args(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("lun").addHandler(handler)
    logging.getLogger("lun").setLevel(logging.INFO)
    try:
        unknown = [a for a in dotlist if a.startswith("-")]
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]} (see --help)")
        if not opt.base:
            raise ConfigError("--base: give the config(s) to inspect")
        if opt.world_size is not None and opt.world_size < 1:
            raise ConfigError(f"--world-size={opt.world_size}: expected a whole number >= 1")
        cfg = merge_configs(opt.base, dotlist)
        translate_legacy_keys(cfg)
        if opt.data_root is not None:
            set_data_root(cfg, opt.data_root)
        if "data" not in cfg:
            raise ConfigError("the merged config has no 'data' section")
        config = data_config(cfg)
        start = time.perf_counter()
        try:
            report = build_report(
                config, decode=opt.decode, world_size=opt.world_size, seed=opt.seed
            )
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err).strip().splitlines()[0]) from err
        report["config"] = " ".join(opt.base + dotlist)
        report["seconds"] = time.perf_counter() - start
        stamp = datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
        out = Path(opt.out or Path("reports") / f"{stamp}_{Path(opt.base[0]).stem}")
        out.mkdir(parents=True, exist_ok=True)
        text = summary(report)
        (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
        (out / "report.json").write_text(json.dumps(report), encoding="utf-8")
        write_html(report, out / "report.html")
        print(text)
        print(f"\nreport: {out / 'report.html'} ({report['seconds']:.1f} s)")
        return 0
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("lun").removeHandler(handler)
