"""Metadata mode: one JSON file per image with tags and a score, filtered and made into captions.

`data_root/metadata/**/*.json`, each `{"tags": [...], "score": N, "path": "images/..."}` (the path
relative to data_root - an absolute one, or one that climbs out with "..", is refused; extra keys
are ignored, and `width`/`height` or `aspect_ratio`, when present, spare opening the image for
`aspect_range` and buckets). JSON that is not UTF-8 is read as lun.data.report.decode_text says.

Filtering by score and tags, and the caption's tag order, are settled once at indexing, as in
translunar-diffusion (the project these options come from, `data/metadata/metadata.py`): each
image's tags are shuffled with probability `shuffle_tag_p`, else sorted (by `caption_sorter`), and
keep that order for the whole run. The shuffle draw is seeded by the run's seed and the image's
path, so the same config and seed give the same captions on every start, rank and resume. Only
`reshuffle_tag_p` draws afresh for every sample (under the batch's seeded streams, lun.rng).
"""

import contextlib
import dataclasses
import difflib
import json
import os
import posixpath
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from ldm.util import instantiate_from_config
from lun.data.index import is_image
from lun.data.report import decode_text


@dataclass(frozen=True)
class MetadataParams:
    """The `metadata_params:` of lun.data.local.Local (absent = flat-file mode).

    consider_every_nth: use only every n-th JSON file in sorted order (e.g. a validation subset).
    exclude_every_nth: leave out every n-th JSON file in sorted order - exactly the files that
        `consider_every_nth: n` takes from the same folder, so a training set with this and a
        validation set with that are disjoint (a held-out split; lun.data.held_out checks it).
    shuffle_tag_p: probability that an image's caption tags are shuffled - drawn once per image at
        indexing (seeded by the run's seed and the image's path), so the image keeps that order
        for the run. Unshuffled tags are sorted (see `caption_sorter`, `sort_tags`).
    reshuffle_tag_p: probability that a sample's tags are shuffled afresh every time it is loaded
        (each epoch sees other orders); 0 = never.
    keep_tokens: the first N tags of the file keep their place (not sorted, not shuffled).
    sort_tags: sort the caption tags of an image that is not shuffled (the original's way);
        `false` keeps the order of the JSON file.
    caption_sorter: {target, params} building the sort key - the object `target(**params)` is
        the `key=` of the sort (as translunar-diffusion's `caption_sorter`); default: the tag.
    blacklist_tags: images with any of these tags are left out.
    non_caption_tags: tags removed from the caption (they still count for filters and bonuses).
    non_caption_tag_prefixes: tags starting with any of these are removed from the caption too
        (e.g. ["artist:", "source:"]).
    skip_caption: every caption is "" (the filters still choose the images).
    replacements: {substring: replacement} applied in order to every caption tag (after the tag
        order is settled), e.g. {"artist:": "by ", ":": "="}; a tag replaced by "" is dropped.
    tag_separator: joins the tags into the caption.
    final_tag_separator: end the caption with `tag_separator` too ("a, b, ").
    abs_min_score: images scoring below this are left out, checked before bonuses.
    min_score: images scoring below this after `tag_bonus_scores` are left out.
    tag_bonus_scores: {tag: bonus} added to the score for `min_score`, to favour or disfavour tags.
    score_tags: thresholds; the caption gets `scrN` for the highest threshold N that the (raw)
        score reaches (score >= N), e.g. [100, 50, 25] and score 70 -> "scr50".
    aspect_range: [min, max] width / height; images outside are left out.
    """

    consider_every_nth: int | None = None
    exclude_every_nth: int | None = None
    shuffle_tag_p: float = 0.0
    reshuffle_tag_p: float = 0.0
    keep_tokens: int = 0
    sort_tags: bool = True
    caption_sorter: dict | None = None
    blacklist_tags: tuple = ()
    non_caption_tags: tuple = ()
    non_caption_tag_prefixes: tuple = ()
    skip_caption: bool = False
    replacements: dict = field(default_factory=dict)
    tag_separator: str = ", "
    final_tag_separator: bool = False
    abs_min_score: float | None = None
    min_score: float | None = None
    tag_bonus_scores: dict = field(default_factory=dict)
    score_tags: tuple = ()
    aspect_range: tuple | None = None

    @classmethod
    def from_config(cls, config) -> "MetadataParams":
        """Validate a `metadata_params:` mapping; unknown keys fail with the nearest known name."""
        config = dict(config or {})
        known = [f.name for f in dataclasses.fields(cls)]
        for key in config:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"metadata_params: unknown key {key!r}{hint}")
        for key in ("blacklist_tags", "non_caption_tags", "non_caption_tag_prefixes", "score_tags"):
            value = config.get(key) or ()
            if isinstance(value, str):  # one prefix or tag written without brackets
                value = (value,)
            config[key] = tuple(value)
        for key in ("replacements", "tag_bonus_scores"):
            config[key] = dict(config.get(key) or {})
        for key in ("shuffle_tag_p", "reshuffle_tag_p"):
            config[key] = _probability(key, config.get(key))
        for key in ("skip_caption", "final_tag_separator", "sort_tags"):
            if key in config and not isinstance(config[key], bool):
                raise ValueError(f"metadata_params.{key}={config[key]!r}: expected true or false")
        params = cls(**config)
        if params.caption_sorter is not None:
            sort_key(params.caption_sorter)  # an import error is a config error, now
        if params.consider_every_nth is not None and params.consider_every_nth < 1:
            raise ValueError("metadata_params.consider_every_nth: expected an integer >= 1")
        if params.exclude_every_nth is not None:
            if isinstance(params.exclude_every_nth, bool) or not (
                isinstance(params.exclude_every_nth, int) and params.exclude_every_nth >= 2
            ):
                raise ValueError("metadata_params.exclude_every_nth: expected an integer >= 2")
            if params.consider_every_nth is not None:
                raise ValueError(
                    "metadata_params.exclude_every_nth: give it or consider_every_nth, not both "
                    "(the training split leaves out what the validation split takes)"
                )
        if params.aspect_range is not None:
            low, high = params.aspect_range
            if not 0 < low <= high:
                raise ValueError(
                    f"metadata_params.aspect_range={list(params.aspect_range)}: need 0 < min <= max"
                )
        return params


def _probability(key: str, value) -> float:
    if value is None:  # the original's default (`null`): never
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"metadata_params.{key}={value!r}: expected a probability in [0, 1]")
    return float(value)


def sort_key(config):
    """The `key=` function a `caption_sorter: {target, params}` builds: `target(**params)`."""
    if not isinstance(config, dict) or "target" not in config:
        raise ValueError(
            f"metadata_params.caption_sorter={config!r}: expected {{target: module.name, "
            "params: {...}}} building the sort key"
        )
    try:
        key = instantiate_from_config(config)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise ValueError(
            f"metadata_params.caption_sorter: cannot build {config['target']!r}: {err}"
        ) from None
    if not callable(key):
        raise ValueError(
            f"metadata_params.caption_sorter: {config['target']!r} built {type(key).__name__}, "
            "not a callable sort key"
        )
    return key


class MetadataError(ValueError):
    """A metadata file that cannot be used: `reason` is the category, `detail` the specifics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason, self.detail = reason, detail


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_metadata(raw: bytes | str) -> dict:
    """{"path", "tags", "score", "aspect" (None unless given)} from one JSON file's bytes (or
    text, already decoded)."""
    text = decode_text(raw)[0] if isinstance(raw, bytes) else raw
    try:
        meta = json.loads(text)
    except ValueError as err:
        raise MetadataError("malformed JSON", str(err)) from None
    if not isinstance(meta, dict):
        raise MetadataError("malformed JSON", f"expected an object, got {type(meta).__name__}")
    missing = [key for key in ("tags", "score", "path") if key not in meta]
    if missing:
        raise MetadataError("missing field", ", ".join(missing))
    tags, score, path = meta["tags"], _number(meta["score"]), meta["path"]
    if isinstance(tags, str):  # some exporters write "a, b, c"
        tags = [tag.strip() for tag in tags.split(",") if tag.strip()]
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise MetadataError("malformed field", "'tags' must be a list of strings")
    if score is None:
        raise MetadataError("malformed field", f"'score' must be a number, got {meta['score']!r}")
    if not isinstance(path, str) or not path:
        raise MetadataError("malformed field", "'path' must be a non-empty string")
    width, height, ratio = (_number(meta.get(key)) for key in ("width", "height", "aspect_ratio"))
    aspect = width / height if width and height and width > 0 and height > 0 else None
    if aspect is None and ratio and ratio > 0:
        aspect = ratio
    return {"path": path, "tags": tags, "score": score, "aspect": aspect}


def image_path(path: str) -> str:
    """A metadata `path` as a normalised path relative to data_root; MetadataError if it leaves
    data_root (absolute, a Windows drive, or climbing out with ".."): a dataset file must not
    make training read files elsewhere on the machine."""
    image = posixpath.normpath(path.replace("\\", "/"))
    if posixpath.isabs(image) or re.match(r"[A-Za-z]:/", image) or image.split("/")[0] == "..":
        raise MetadataError("path outside data_root", path)
    return image


def metadata_records(
    path_of, listing, every_nth: int | None, exclude_every_nth: int | None = None
) -> tuple[dict, list, list, int]:
    """Columns {"image", "tags", "score", "aspect"} from `metadata/**/*.json` (`path_of`: the
    local file of a path relative to data_root - lun.data.local.Local.path), the
    [(path, reason, detail)] of metadata files left out (unreadable, malformed, image missing,
    path outside data_root), those of files kept with a problem (not UTF-8), and how many files
    `consider_every_nth` / `exclude_every_nth` passed over (counted, not listed: a choice, not bad
    input)."""
    sizes = {rel: size for rel, size, _ in listing}
    under = [rel for rel in sizes if rel.startswith("metadata/")]
    found = [rel for rel in under if rel.lower().endswith(".json")]
    # A metadata.jsonl or .csv beside the .json files is not read: say so, not pass over it.
    skipped = [
        (rel, "not a .json file", "one JSON object per file")
        for rel in under
        if not rel.lower().endswith(".json")
    ]
    noted = []
    files = found[:: every_nth or 1]
    if exclude_every_nth:  # the complement of files[::exclude_every_nth]
        files = [rel for i, rel in enumerate(files) if i % exclude_every_nth]
    records = {"image": [], "tags": [], "score": [], "aspect": []}
    for rel in files:
        try:
            with open(path_of(rel), "rb") as file:
                text, problem = decode_text(file.read())
            meta = parse_metadata(text)
            image = image_path(meta["path"])
            if not is_image(image):
                raise MetadataError("unsupported image type", image)
            size = sizes.get(image)
            if size is None:  # outside the walk (a hidden folder)
                with contextlib.suppress(OSError):
                    local = path_of(image)
                    size = os.path.getsize(local) if os.path.isfile(local) else None
            if size is None:
                raise MetadataError("image not found", image)
            if size == 0:
                raise MetadataError("zero-byte image", image)
        except MetadataError as err:
            skipped.append((rel, err.reason, err.detail))
            continue
        except OSError as err:
            skipped.append((rel, "unreadable", str(err)))
            continue
        if problem is not None:
            noted.append((rel, problem, ""))
        records["image"].append(image)
        records["tags"].append(meta["tags"])
        records["score"].append(meta["score"])
        records["aspect"].append(meta["aspect"])
    return records, skipped, noted, len(found) - len(files)


def _threshold_name(threshold) -> str:
    return f"{threshold:g}" if isinstance(threshold, float) else str(threshold)


def bonus_score(score: float, tags: set, params: MetadataParams) -> float:
    """The score `min_score` is checked against: the raw score plus every `tag_bonus_scores`
    entry whose tag the image has."""
    return score + sum(float(v) for tag, v in params.tag_bonus_scores.items() if tag in tags)


def drop_reason(score: float, tags: set, aspect, params: MetadataParams) -> str | None:
    """Why the score and tag filters leave an image out, or None when it is kept: the one owner
    of these rules (the dataset applies it, the dataset report counts its answers). Checked in
    this order, the first that applies names the reason: `abs_min_score` (raw score), a
    blacklisted tag (named: the first of `blacklist_tags` the image has), `min_score` (after
    bonuses), `aspect_range`."""
    if params.abs_min_score is not None and score < params.abs_min_score:
        return "below abs_min_score"
    for tag in params.blacklist_tags:
        if tag in tags:
            return f"blacklisted tag {tag!r}"
    if params.min_score is not None and bonus_score(score, tags, params) < params.min_score:
        return "below min_score after bonuses"
    if params.aspect_range is not None and not (
        params.aspect_range[0] <= aspect <= params.aspect_range[1]
    ):
        return "outside aspect_range"
    return None


def select(
    records: dict, params: MetadataParams, seed: int = 0
) -> tuple[list[int], list[list[str]], Counter]:
    """Rows that pass the score and tag filters (`drop_reason`), their caption tags, and how many
    rows each reason left out.

    Caption tags: the image's tags minus `non_caption_tags` and `non_caption_tag_prefixes`, plus
    the score tag; past the first `keep_tokens`, shuffled (with probability `shuffle_tag_p`, a
    draw seeded by `seed` and the image's path) or else sorted; then `replacements`. None at all
    with `skip_caption`.
    """
    hidden = set(params.non_caption_tags)
    prefixes = tuple(params.non_caption_tag_prefixes)
    thresholds = sorted(params.score_tags, reverse=True)
    key = sort_key(params.caption_sorter) if params.caption_sorter is not None else None
    rows, captions, filtered = [], [], Counter()
    for row, (image, tags, score, aspect) in enumerate(
        zip(records["image"], records["tags"], records["score"], records["aspect"])
    ):
        reason = drop_reason(score, set(tags), aspect, params)
        if reason is not None:
            filtered[reason] += 1
            continue
        rows.append(row)
        if params.skip_caption:
            captions.append([])
            continue
        caption = [t for t in tags if t not in hidden and not (prefixes and t.startswith(prefixes))]
        reached = next((t for t in thresholds if score >= t), None)
        if reached is not None:
            caption.append(f"scr{_threshold_name(reached)}")
        caption = _order(caption, params, key, random.Random(f"{seed}\x1f{image}"))
        replaced = []
        for tag in caption:
            for old, new in params.replacements.items():
                tag = tag.replace(old, new)
            if tag:
                replaced.append(tag)
        captions.append(replaced)
    return rows, captions, filtered


def _order(tags: list[str], params: MetadataParams, key, rng: random.Random) -> list[str]:
    """The image's tag order for the run: the first `keep_tokens` in place, the rest shuffled
    with probability `shuffle_tag_p` (a draw of `rng`, seeded per image), else sorted by `key`.
    Sorting happens before `replacements`, by the names in the file, as the original did."""
    head, tail = tags[: params.keep_tokens], tags[params.keep_tokens :]
    if params.shuffle_tag_p > 0 and rng.random() < params.shuffle_tag_p:
        rng.shuffle(tail)
    elif params.sort_tags:
        tail.sort(key=key)
    return head + tail


def build_caption(tags: list[str], params: MetadataParams, rng: random.Random | None = None) -> str:
    """Join the caption tags (in the order `select` settled), first shuffling all but the first
    `keep_tokens` with probability `reshuffle_tag_p` - a fresh draw for every sample."""
    if params.skip_caption:
        return ""
    rng = rng or random
    if params.reshuffle_tag_p > 0 and rng.random() < params.reshuffle_tag_p:
        head, tail = tags[: params.keep_tokens], list(tags[params.keep_tokens :])
        rng.shuffle(tail)
        tags = head + tail
    caption = params.tag_separator.join(tags)
    return caption + params.tag_separator if params.final_tag_separator else caption
