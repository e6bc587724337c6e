"""lun.data.local.Local: a dataset from a local folder, in flat-file or metadata mode.

Flat files (no `metadata_params`):

    data_root/images/**/<name>.<png|jpg|jpeg|webp|bmp>
    data_root/captions/**/<name>.txt     (same relative path; or <name>.txt beside the image)

Metadata (`metadata_params` given): data_root/metadata/**/*.json, see lun/data/metadata.py.

Bad input never stops a run. Zero-byte files, malformed or incomplete JSON, metadata paths that
leave data_root and (when headers are read) non-images are left out at indexing; an image that
fails to decode at load time is replaced by another sample; a caption file that is not UTF-8 is
read by its byte-order mark or as cp1252 (lun.data.report.decode_text). Each such file is named
once in the log (logger "lun.data") and counted in the summaries after indexing and at every
epoch boundary.
"""

import difflib
import inspect
import logging
import os
import random
import time
from collections import Counter

import numpy as np
import torch

from ldm.util import ParamError
from lun.data.buckets import BucketSpec, assign_buckets, make_buckets
from lun.data.images import (
    CROPS,
    DEFAULT_MAX_PIXELS,
    INTERPOLATIONS,
    ImageError,
    check_choice,
    check_max_pixels,
    decode_image,
    load_image_sample,
)
from lun.data.index import (
    StringArray,
    cache_key,
    captions_elsewhere,
    default_cache_dir,
    describe_listing,
    flat_records,
    is_image,
    keep_rows,
    load_cached,
    read_aspects,
    save_cached,
    walk,
)
from lun.data.metadata import (
    MetadataParams,
    bonus_score,
    build_caption,
    metadata_records,
    select,
)
from lun.data.report import MAX_FRESH_FAILURES, BadInputLog, decode_text
from lun.storage import FileCache, is_url, join, list_files

logger = logging.getLogger("lun.data")

TAG_JOINER = "\x1f"  # ASCII unit separator: cannot occur in a tag typed by a person
# `mode:` of configs written for translunar-diffusion, whose Local had no such parameter: the
# DataModule's section (train / validation) already says what a dataset is for.
LEGACY_MODES = ("train", "val", "validation")
# open-diffusion's dataset keys and the keys that mean the same here.
OTHER_NAMES = {
    "path": "data_root",
    "resolution": "size",
    "workers": "num_workers (a loader setting: data.params or the split's section)",
}


def _refuse_unknown(unknown: dict) -> None:
    """ParamError (a ValueError, and the TypeError Python would raise) naming the first key Local
    does not take, and ours where another project's dataset spells it differently. (Local takes
    `**unknown` only to say this.)"""
    if not unknown:
        return
    name = sorted(unknown)[0]
    if name in OTHER_NAMES:
        raise ParamError(
            f"{name}: not a parameter of lun.data.local.Local (open-diffusion's name); "
            f"here it is {OTHER_NAMES[name]}"
        )
    known = [p for p in inspect.signature(Local).parameters if p != "unknown"]
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ParamError(f"{name}: not a parameter of lun.data.local.Local{hint}")


def _accept_mode(mode) -> None:
    if mode is None:
        return
    if mode not in LEGACY_MODES:
        raise ValueError(
            f"mode={mode!r}: expected one of {', '.join(map(repr, LEGACY_MODES))} (or none: "
            "the DataModule's train/validation section decides a dataset's use)"
        )
    logger.warning(
        "mode=%r: has no effect here - the DataModule's section (train/validation) decides "
        "a dataset's use",
        mode,
    )


class Local(torch.utils.data.Dataset):
    """Images and captions from a local folder; items are {"image": (3, H, W) float32 in [-1, 1],
    "caption": str} and the image's geometry for SDXL's size conditioning: `original_size_as_tuple`
    (height, width) before resizing, `crop_coords_top_left` (top, left) in the resized image,
    `target_size_as_tuple` (H, W) (int64 tensors of 2).

    data_root: the dataset folder (see the module docstring for its layout).
    size: output side in pixels; images are resized to cover size x size and cropped.
    interpolation: resampling filter - "bilinear", "bicubic" or "lanczos".
    flip_p: probability of a horizontal flip.
    crop: "center" or "random" (where the crop window sits in the resized image).
    Captions are returned as they are: dropout for classifier-free guidance is the model's
    (`model.params.ucg_rate`); a legacy `caption_dropout` here is moved there by lun.config.
    metadata_params: absent for flat files; a mapping of lun.data.metadata.MetadataParams for
        metadata mode (score and tag filters, tag shuffling, replacements, aspect_range ...).
    limit_images: use at most this many items (a fixed random subset), e.g. for a quick test.
    missing_caption: flat files only - an image without a caption trains with "" and a warning
        ("empty"), or is left out ("skip").
    buckets: aspect-ratio buckets - `true` or {area, step, max_aspect} (see
        lun.data.buckets.BucketSpec); each image is resized to cover its bucket and cropped, and
        batches hold one bucket each.
    verify_images: read every image header at indexing, so non-images are left out up front
        (always done when buckets or aspect_range need the sizes).
    cache_dir: where the index is cached (default $LUN_CACHE_DIR or ~/.cache/lun/index;
        `false` disables the cache). Point it beside the logs to keep runs self-contained.
    max_image_pixels: images with more pixels are refused as decompression bombs.
    mode: accepted for configs written for translunar-diffusion ("train", "val" or
        "validation") with one warning: the DataModule section a dataset sits in says its use.
    """

    def __init__(
        self,
        data_root: str,
        size: int = 512,
        interpolation: str = "bicubic",
        flip_p: float = 0.0,
        crop: str = "center",
        metadata_params: dict | None = None,
        limit_images: int | None = None,
        missing_caption: str = "empty",
        buckets: bool | dict | None = None,
        verify_images: bool = False,
        cache_dir: str | bool | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        mode: str | None = None,
        **unknown,
    ):
        # ValueErrors name the parameter first: the launcher reports them as config errors.
        _refuse_unknown(unknown)
        _accept_mode(mode)
        if not isinstance(data_root, str) or not data_root:
            raise ValueError(f"data_root={data_root!r}: expected the dataset's folder")
        if not is_url(data_root) and not os.path.isdir(data_root):
            what = "is not a folder" if os.path.exists(data_root) else "does not exist"
            raise ValueError(f"data_root={data_root!r} {what}: expected the dataset's folder")
        if isinstance(flip_p, bool) or not isinstance(flip_p, int | float) or not 0 <= flip_p <= 1:
            raise ValueError(f"flip_p={flip_p!r}: expected a probability in [0, 1]")
        for name, value in (("size", size), ("limit_images", limit_images)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name}={value!r}: expected a whole number >= 1")
        self.data_root, self.size = data_root, size
        self.interpolation = check_choice("interpolation", interpolation, INTERPOLATIONS)
        self.crop = check_choice("crop", crop, CROPS)
        self.missing_caption = check_choice("missing_caption", missing_caption, ("empty", "skip"))
        self.flip_p = flip_p
        self.max_image_pixels = check_max_pixels(max_image_pixels)
        self._listing, self._cache = None, None  # a URL's objects and the local copies read
        if is_url(data_root):
            self._listing, self._cache = {}, FileCache()
        self.metadata = None
        if metadata_params is not None:
            self.metadata = MetadataParams.from_config(metadata_params)
        bucket_spec = BucketSpec.from_config(buckets, self.size) if buckets else None
        self.bad_input = BadInputLog(data_root)

        aspect_range = self.metadata.aspect_range if self.metadata else None
        need_aspect = bool(buckets or verify_images or aspect_range)
        cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        listing, records = self._index(need_aspect, cache_dir)  # sets self.counts
        self.scores = None  # metadata mode: (raw, after tag bonuses) of every indexed item
        captions = self._captions_of(records, listing)
        rows = range(len(records["image"]))
        if limit_images is not None and limit_images < len(rows):
            rows = sorted(random.Random(0).sample(rows, int(limit_images)))
            self.counts["dropped"]["over limit_images"] = len(captions) - len(rows)
        self.counts["usable"] = len(rows)
        if not rows:
            raise ValueError(
                f"data_root={data_root!r} has no usable items: found {describe_listing(listing)}; "
                f"{self.bad_input.describe()}. Expected images/**/<name>.png|jpg|jpeg|webp|bmp "
                "with captions/**/<name>.txt"
                + (", and metadata/**/*.json naming them (metadata mode)" if self.metadata else "")
            )
        self._images = StringArray(records["image"][i] for i in rows)
        # Flat files: the caption file's path; metadata: the caption tags joined by TAG_JOINER.
        self._captions = StringArray(captions[i] or "" for i in rows)
        if bucket_spec is not None:
            self.bucket_sizes = make_buckets(bucket_spec)
            aspects = [records["aspect"][i] for i in rows]
            self.batch_groups = assign_buckets(aspects, self.bucket_sizes)
        else:
            self.bucket_sizes = [(self.size, self.size)]
            self.batch_groups = np.zeros(len(rows), dtype=np.int64)
        self.bad_input.track_items(len(rows))
        self.bad_input.summarize_index(len(rows))

    def _index(self, need_aspect: bool, cache_dir) -> tuple[list, dict]:
        """Walk the folder and build its records, or load them from the cache."""
        start = time.perf_counter()
        unusable = []  # broken links, names that are not UTF-8: counted below, never cached
        listing = list_files(self.data_root) if self._cache else walk(self.data_root, unusable)
        if self._cache is not None:
            self._listing = {rel: {"size": size, "version": stamp} for rel, size, stamp in listing}
        every_nth = self.metadata.consider_every_nth if self.metadata else None
        exclude_nth = self.metadata.exclude_every_nth if self.metadata else None
        options = {
            "metadata": self.metadata is not None,
            "every_nth": every_nth,
            "aspect": need_aspect,
        }
        if exclude_nth:  # (only then: the indexes cached before this option keep their keys)
            options["exclude_every_nth"] = exclude_nth
        if need_aspect:  # header reads refuse images above the limit: a new limit, a new index
            options["max_pixels"] = self.max_image_pixels
        key = cache_key(self.data_root, listing, options)
        index = load_cached(cache_dir or None, key)
        cached = index is not None
        if index is None:
            noted, passed_over = [], 0  # [(path, reason, detail)] of files kept with a problem
            if self.metadata is None:
                records, skipped = flat_records(listing)
            else:
                records, skipped, noted, passed_over = metadata_records(
                    self.path, listing, every_nth, exclude_nth
                )
            if need_aspect:
                skipped += read_aspects(self.path, records, self.max_image_pixels)
            index = {
                "records": records,
                "skipped": skipped,
                "noted": noted,
                "not_every_nth": passed_over,
            }
            save_cached(cache_dir or None, key, index)
        dropped = Counter()
        if every_nth or exclude_nth:
            rules = [f"consider_every_nth={every_nth}"] * bool(every_nth)
            rules += [f"exclude_every_nth={exclude_nth}"] * bool(exclude_nth)
            dropped[f"not every nth ({', '.join(rules)})"] = index["not_every_nth"]
        dropped.update(reason for _, reason, _ in index["skipped"])
        unusable = [entry for entry in unusable if is_image(entry[0])]
        if self.metadata is not None:  # items are metadata files: a file they name is "not found"
            for rel, reason, detail in unusable:
                logger.warning("%s: %s (%s)", os.path.join(self.data_root, rel), reason, detail)
            unusable = []
        dropped.update(reason for _, reason, _ in unusable)
        # What each rule decided, in the order the rules apply: {found, dropped {reason: n},
        # indexed, noted {problem of a kept item: n}, usable}; lun.data.dataset_report prints it.
        self.counts = {
            "found": len(index["records"]["image"]) + sum(dropped.values()),
            "dropped": dropped,
            "indexed": len(index["records"]["image"]),
            "noted": Counter(reason for _, reason, _ in index["noted"]),
        }
        for rel, reason, detail in index["skipped"] + unusable:
            self.bad_input.skip(os.path.join(self.data_root, rel), reason, detail)
        for rel, reason, detail in index["noted"]:
            self.bad_input.warn(os.path.join(self.data_root, rel), reason, detail)
        logger.info(
            "%s: indexed %d files in %.2f s%s",
            self.data_root,
            len(listing),
            time.perf_counter() - start,
            " (from cache)" if cached else "",
        )
        return listing, index["records"]

    def _captions_of(self, records: dict, listing) -> list[str | None]:
        """Apply the caption rules, dropping rows from `records` in place; one entry per row.

        Flat files: the caption file's path (None: none found - kept with a warning, or left out).
        Metadata: the score and tag filters, then the caption tags joined by TAG_JOINER.
        """
        if self.metadata is not None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, as the loader's
            if self.metadata.tag_bonus_scores:
                with_bonus = [
                    bonus_score(score, set(tags), self.metadata)
                    for score, tags in zip(records["score"], records["tags"])
                ]
            else:
                with_bonus = records["score"]
            self.scores = (np.asarray(records["score"]), np.asarray(with_bonus, dtype=np.float64))
            rows, tag_lists, filtered = select(records, self.metadata, seed)
            self.counts["dropped"].update(filtered)
            keep_rows(records, rows)
            if filtered:
                why = ", ".join(f"{n} {reason}" for reason, n in filtered.items())
                logger.info("%s: filtered out %s", self.data_root, why)
            return [TAG_JOINER.join(tags) for tags in tag_lists]
        keep = []
        uncaptioned = records["caption"].count(None)
        if (
            uncaptioned
            and uncaptioned == len(records["caption"])
            and self.missing_caption != "skip"
        ):
            elsewhere = captions_elsewhere(listing)
            if elsewhere is not None:  # the captions are there, in a layout not read here
                raise ValueError(
                    f"data_root={self.data_root!r}: none of its {uncaptioned} images has a "
                    f"caption file, but it holds {elsewhere[0]}; {elsewhere[1]}"
                )
            # A folder of images alone (a class or a style): one line, not one per image.
            logger.warning(
                "%s: no image has a caption: all %d train with an empty caption (the caption "
                "of images/a.png is captions/a.txt or images/a.txt)",
                self.data_root,
                uncaptioned,
            )
            self.bad_input.warned["no caption"] += uncaptioned
            self.counts["noted"]["no caption (trained with an empty caption)"] += uncaptioned
            return records["caption"]
        for row, (image, caption) in enumerate(zip(records["image"], records["caption"])):
            if caption is None:
                path = os.path.join(self.data_root, image)
                if self.missing_caption == "skip":
                    self.bad_input.skip(path, "no caption")
                    self.counts["dropped"]["no caption"] += 1
                    continue
                self.bad_input.warn(path, "no caption", "trained with an empty caption")
                self.counts["noted"]["no caption (trained with an empty caption)"] += 1
            keep.append(row)
        keep_rows(records, keep)
        return records["caption"]

    def path(self, rel: str) -> str:
        """The local file of `rel`: under data_root, or a URL's copy in the file cache."""
        if self._cache is None:
            return os.path.join(self.data_root, rel)
        if rel not in self._listing:
            raise FileNotFoundError(join(self.data_root, rel))
        return self._cache.local_path(join(self.data_root, rel), self._listing[rel])

    def __len__(self) -> int:
        return len(self._images)

    def image_name(self, index: int) -> str:
        """The image file of item `index`, relative to data_root ("/" separators)."""
        return self._images[index]

    def item_size(self, index: int) -> tuple[int, int]:
        """(width, height) of item `index` - its bucket, or size x size."""
        return self.bucket_sizes[int(self.batch_groups[index])]

    def caption(self, index: int) -> str:
        """The caption of item `index` (metadata mode: reshuffled if `reshuffle_tag_p` says)."""
        stored = self._captions[index]
        if self.metadata is not None:
            return build_caption(stored.split(TAG_JOINER) if stored else [], self.metadata)
        if not stored:
            return ""
        path = os.path.join(self.data_root, stored)
        with open(self.path(stored), "rb") as file:
            text, problem = decode_text(file.read())
        if problem is not None:
            self.bad_input.load_note(index, path, problem)
        return text.strip()

    def check_readable(self) -> None:
        """Decode images until one works (no random number is drawn); ValueError naming data_root
        when none of the first MAX_FRESH_FAILURES does. The launcher calls this before it creates
        the run folder, so a folder of unreadable files stops there, not inside `fit`."""
        tried = min(len(self), MAX_FRESH_FAILURES)
        for index in range(tried):
            path = os.path.join(self.data_root, self._images[index])
            try:
                decode_image(
                    self.path(self._images[index]),
                    cover=self.item_size(index),
                    max_pixels=self.max_image_pixels,
                )
                return
            except (ImageError, OSError) as err:
                self.bad_input.load_failed(index, path, err)
                last = err
        raise ValueError(
            f"data_root={self.data_root!r} has no usable image: the first {tried} cannot be "
            f"read (the last: {last})"
        )

    def _load(self, index: int, size: tuple[int, int]) -> dict:
        sample = load_image_sample(
            self.path(self._images[index]),
            size,
            self.interpolation,
            self.crop,
            self.flip_p,
            max_pixels=self.max_image_pixels,
        )  # image (3, H, W), its original size and crop (SDXL's size conditioning)
        return {**sample, "caption": self.caption(index)}

    def __getitem__(self, index: int) -> dict:
        """Item `index`, or - if its files cannot be read - the next readable item, resized to
        `index`'s size so that it still fits `index`'s bucket."""
        size, fresh_failures = self.item_size(index), 0
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            if self.bad_input.is_known_bad(candidate):
                continue
            try:
                return self._load(candidate, size)
            except (ImageError, OSError) as err:
                self.bad_input.load_failed(
                    candidate, os.path.join(self.data_root, self._images[candidate]), err
                )
                fresh_failures += 1
                if fresh_failures >= MAX_FRESH_FAILURES:
                    break
        raise RuntimeError(
            f"{self.data_root}: {fresh_failures} images in a row failed to load, "
            f"{int(self.bad_input.failed.sum())} of {len(self)} in all - is the folder readable?"
        )
