"""Large sets as streams of shards: WebDataset tar shards and Parquet files.

Both yield whole batches ({"image": (B, 3, H, W) in [-1, 1], "caption": list[str]}) from an
IterableDataset, so lun.data.DataModule loads them with `batch_size=None`:

- Shards are split across (rank, worker) slots: every slot reads different shards (in a new order
  each epoch) and cycles through them until it has produced its quota, so every rank yields exactly
  `len(dataset)` = ceil(num_examples_to_see / (batch_size * world_size)) batches - no rank waits
  at the epoch's end.
- Samples pass the metadata `filters` before any image is decoded, then a shuffle buffer.
- Everything is deterministic per (seed, epoch, slot), so a resumed run skips the consumed batches
  without decoding them (exact while world size and num_workers stay the same, and while no
  image in the skipped part fails to decode).
- A sample with an undecodable image or missing a filtered key is dropped, counted, and named once
  per worker in the log (logger "lun.data"); each worker summarises its drops after each epoch.
"""

import contextlib
import io
import itertools
import json
import logging
import os
import random
import re
from collections import Counter

import torch
from braceexpand import braceexpand
from torch.utils.data import default_collate, get_worker_info

from lun.data.buckets import resume_point
from lun.data.images import (
    CROPS,
    DEFAULT_MAX_PIXELS,
    INTERPOLATIONS,
    ImageError,
    check_choice,
    load_image_sample,
)
from lun.data.report import decode_text
from lun.rng import seeded
from lun.storage import filesystem, is_url, object_infos, open_cached, protocol

logger = logging.getLogger("lun.data")

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
_FILTER = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(.*?)\s*$")
_COMPARE = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
# URL schemes webdataset's `gopen` reads (curl and friends); other URLs go through fsspec
# (lun.storage: s3://, gs://, ...), listed up front and read through the size-bounded file cache.
GOPEN_SCHEMES = ("http", "https", "sftp", "ftps", "scp", "ais", "htgs", "hf")
# Consecutive undecodable images after which the stream is declared broken rather than skipped.
MAX_FRESH_FAILURES = 1000
# Samples of the first shard read before training to find at least one caption (check_readable).
CAPTION_PROBE = 32


def parse_filters(filters) -> list[tuple[str, str, float | str]]:
    """{key: ">=512", pwatermark: "<=0.5", status: "success"} -> [(key, op, operand)].

    Operators: >=, <=, >, <, ==, != ; a bare value means ==. Numeric operands compare numerically.
    Dotted keys ("exif.width") reach into nested metadata.
    """
    parsed = []
    for key, spec in dict(filters or {}).items():
        match = _FILTER.match(str(spec)) if isinstance(spec, str) else None
        op, operand = (match.group(1), match.group(2)) if match else ("==", spec)
        try:
            operand = float(operand)
        except (TypeError, ValueError):
            if op not in ("==", "!="):
                raise ValueError(f"filters.{key}={spec!r}: {op} needs a number") from None
            operand = str(operand)
        parsed.append((str(key), op, operand))
    return parsed


def _lookup(meta: dict, dotted: str):
    value = meta
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_filters(meta: dict, filters) -> str | None:
    """None if `meta` passes every filter, else why not ("missing <key>" or "<key> <op> <x>")."""
    for key, op, operand in filters:
        value = _lookup(meta, key)
        if value is None:
            return f"missing {key}"
        if isinstance(operand, float):
            try:
                value = float(value)
            except (TypeError, ValueError):
                return f"non-numeric {key}"
        else:
            value = str(value)
        if not _COMPARE[op](value, operand):
            return (
                f"{key} not {op} {operand:g}"
                if isinstance(operand, float)
                else f"{key} not {op} {operand}"
            )
    return None


def load_prompts(idx_to_prompt) -> dict[str, list[str]] | None:
    """Class index -> prompts, from a JSON file path or an inline mapping/list.

    {"0": "tench", "1": ["goldfish", "a goldfish"]} or ["tench", "goldfish", ...]; with several
    prompts for a class, each sample draws one.
    """
    if idx_to_prompt is None:
        return None
    if isinstance(idx_to_prompt, str):
        with open(idx_to_prompt, encoding="utf-8") as file:
            idx_to_prompt = json.load(file)
    items = (
        enumerate(idx_to_prompt) if isinstance(idx_to_prompt, list) else dict(idx_to_prompt).items()
    )
    prompts = {str(k): [v] if isinstance(v, str) else [str(p) for p in v] for k, v in items}
    for key in prompts:  # the ids are also the items' labels (class-conditional models)
        if not key.lstrip("-").isdigit():
            raise ValueError(f"idx_to_prompt: keys are class ids (whole numbers), got {key!r}")
    return prompts


def shuffle_buffer(samples, size: int, rng: random.Random, initial: int = 100):
    """Approximately shuffle an endless iterator: hold up to `size` samples, emit a random one.

    Emitting starts once `initial` samples are held and the buffer keeps growing by one per step
    until `size` (as webdataset's shuffle does), so the first batch does not wait for a full buffer.
    """
    buffer = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) < size:
            buffer.append(next(samples))
        if len(buffer) >= min(size, initial):
            index = rng.randrange(len(buffer))
            buffer[index], buffer[-1] = buffer[-1], buffer[index]
            yield buffer.pop()


class ShardStream(torch.utils.data.IterableDataset):
    """Common machinery of WebDataset and Parquet: sharding, quotas, filters, decoding, resume.

    Subclasses provide `shard_list()` and `read_shard(shard)`, which yields raw samples
    {"key", "image": bytes | None, "caption": str | None, "cls": value | None, "meta": dict}.
    """

    def __init__(
        self,
        num_examples_to_see: int,
        size: int,
        interpolation: str,
        crop: str,
        flip_p: float,
        filters,
        idx_to_prompt,
        shuffle_buffer: int,
        max_image_pixels: int,
    ):
        if not num_examples_to_see or int(num_examples_to_see) < 1:
            raise ValueError(
                "num_examples_to_see: samples per epoch, a positive integer, is required"
            )
        self.num_examples_to_see, self.size = int(num_examples_to_see), int(size)
        self.interpolation = check_choice("interpolation", interpolation, INTERPOLATIONS)
        self.crop = check_choice("crop", crop, CROPS)
        self.flip_p = flip_p
        self.max_image_pixels = max_image_pixels
        self.filters = parse_filters(filters)
        self.prompts = load_prompts(idx_to_prompt)
        self.shuffle_buffer = int(shuffle_buffer)
        # [epoch, epoch to skip in, batches to skip] in shared memory: persistent DataLoader workers
        # keep their own copy of this object, and must still see the epoch the main process set.
        self._state = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._epoch_chosen = True
        self._reported = set()  # sample keys this worker has named in the log
        self.configure(batch_size=1)

    def configure(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        """Set by lun.data.DataModule before loading: batch size, order, and this process's rank."""
        self.batch_size, self.shuffle, self.seed = int(batch_size), shuffle, int(seed)
        self.rank, self.world_size = int(rank), int(world_size)

    def __len__(self) -> int:
        """Batches per rank per epoch."""
        return -(-self.num_examples_to_see // (self.batch_size * self.world_size))

    # -- epochs and resume (main process) --------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self._state[0] = epoch
        self._epoch_chosen = True

    def begin_epoch(self) -> None:
        """Called each time a DataLoader starts iterating: the chosen epoch first, then the next."""
        if not self._epoch_chosen:
            self._state[0] += 1
        self._epoch_chosen = False

    def state_dict(self) -> dict:
        return {
            "epoch": int(self._state[0]),
            "position": 0,
            "world_size": self.world_size,
            "num_batches": len(self),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        epoch, position = resume_point(state, len(self), self.world_size)
        self._state[:] = torch.tensor([epoch, epoch, position])
        self._epoch_chosen = True

    # -- the stream (worker processes) -----------------------------------------------------------
    def _my_shards(self, epoch: int, slot: int, slots: int) -> list:
        shards = list(self.shard_list())
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(shards)
        mine = shards[slot::slots]
        if not mine:
            if slot == 0:
                logger.warning(
                    "%d shards for %d rank x worker slots: slots share shards", len(shards), slots
                )
            mine = [shards[slot % len(shards)]]
        return mine

    def _prepared(self, shards: list, rng: random.Random, counts: Counter):
        """Endless raw samples that pass the cheap checks (image present, filters, class prompt)."""
        for cycle in itertools.count():
            if cycle and self.shuffle:
                rng.shuffle(shards)
            passed = 0
            for shard in shards:
                for raw in self._read_logged(shard, counts):
                    why = self._reject(raw)
                    if why is not None:
                        counts[why] += 1
                        continue
                    passed += 1
                    yield raw
            if not passed:
                raise RuntimeError(f"no usable samples in shards {shards[:3]}...: {dict(counts)}")

    def _read_logged(self, shard, counts: Counter):
        try:
            yield from self.read_shard(shard)
        except Exception as err:  # a truncated or unreachable shard must not end the run
            counts["unreadable shard"] += 1
            logger.warning(
                "shard %s: %s: %s (continuing with the next shard)", shard, type(err).__name__, err
            )

    def _reject(self, raw: dict) -> str | None:
        if raw["image"] is None:
            return "no image"
        if self.prompts is not None and str(raw["cls"]) not in self.prompts:
            return "no class prompt"
        return check_filters(raw["meta"], self.filters) if self.filters else None

    def _item(self, raw: dict) -> dict:
        """Decode one sample. Its random draws use the `random` module (seeded per batch), not
        the ordering rng, so skipping samples on resume leaves the order of the rest unchanged."""
        size = (self.size, self.size)
        sample = load_image_sample(
            io.BytesIO(raw["image"]),
            size,
            self.interpolation,
            self.crop,
            self.flip_p,
            max_pixels=self.max_image_pixels,
        )  # image (3, H, W), its original size and crop (SDXL's size conditioning)
        if self.prompts is None:
            return {**sample, "caption": raw["caption"] or ""}
        # Class-conditional mode: a prompt of the class, and its id for ldm.conditioning.ClassLabels.
        label = str(raw["cls"])
        return {**sample, "caption": random.choice(self.prompts[label]), "label": int(label)}

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, skip_epoch, consumed = (int(v) for v in self._state.tolist())
        consumed = consumed if epoch == skip_epoch else 0
        # The DataLoader takes batches round-robin from worker 0 on: batch j of the epoch comes from
        # the worker in role j % workers. After a resume at batch k, worker 0 must play role
        # k % workers, and each role skips the batches it had already delivered.
        role = (worker + consumed) % workers
        per_rank = len(self)
        quota = per_rank // workers + (role < per_rank % workers)
        skip = consumed // workers + (role < consumed % workers)
        slot, slots = self.rank * workers + role, self.world_size * workers
        rng = random.Random(f"{self.seed}/{epoch}/{slot}")  # the order, and nothing else
        counts = Counter()
        samples = self._prepared(self._my_shards(epoch, slot, slots), rng, counts)
        if self.shuffle and self.shuffle_buffer > 1:
            samples = shuffle_buffer(samples, self.shuffle_buffer, rng)
        for _ in range(skip * self.batch_size):  # resume: skipped without decoding
            next(samples)
        for number in range(skip, quota):
            # Decoding draws (flips, crops, class prompts) from streams seeded by the batch's
            # place in this slot's stream: a resumed stream, which skips batches undecoded,
            # still decodes the rest as the uninterrupted one did.
            with seeded((self.seed, epoch, slot, number)):
                batch = self._batch(samples, counts)
            yield batch
        if counts:
            logger.info("rank %d worker %d epoch %d: %s", self.rank, worker, epoch, dict(counts))

    def _batch(self, samples, counts: Counter) -> dict:
        """One batch of decoded samples; undecodable ones are dropped and named once."""
        batch, fresh_failures = [], 0
        while len(batch) < self.batch_size:
            raw = next(samples)
            try:
                batch.append(self._item(raw))
            except ImageError as err:
                counts[err.reason] += 1
                fresh_failures += 1
                if raw["key"] not in self._reported:
                    self._reported.add(raw["key"])
                    logger.warning("dropped %s: %s", raw["key"], err)
                if fresh_failures >= MAX_FRESH_FAILURES:
                    raise RuntimeError(f"{fresh_failures} undecodable images in a row") from err
                continue
            fresh_failures = 0
            if raw["caption"] is None and self.prompts is None:
                counts["no caption (trained with '')"] += 1
            if raw.get("caption_problem"):
                counts[f"caption {raw['caption_problem']}"] += 1
        return default_collate(batch)


def on_fsspec(url: str) -> bool:
    return is_url(url) and protocol(url) not in GOPEN_SCHEMES


def expand_urls(urls) -> list[str]:
    """Brace-expand one pattern or a list of them: "shards/{000..099}.tar", "pipe:curl -s ..."."""
    patterns = [urls] if isinstance(urls, str) else list(urls)
    return [url for pattern in patterns for url in braceexpand(pattern)]


class WebDataset(ShardStream):
    """WebDataset tar shards: `<key>.jpg|jpeg|png|webp` + `<key>.txt` (+ `<key>.json` metadata,
    + `<key>.cls` in class-conditional mode), e.g. as written by img2dataset.

    urls: shard pattern(s) in brace notation - local paths, fsspec URLs ("s3://bucket/
        {00000..00999}.tar", "gs://...": read through a local cache bounded by
        $LUN_FILE_CACHE_GB, see lun.storage), http(s) URLs, or `pipe:` commands writing a tar
        to stdout.
    num_examples_to_see: samples per epoch over all ranks (sets the epoch's length).
    size, interpolation, crop, flip_p: as in lun.data.local.Local (captions are never dropped
        here: see `model.params.ucg_rate`).
    filters: {json_key: ">=512", pwatermark: "<=0.5"}; samples missing a filtered key are dropped.
    idx_to_prompt: class-conditional mode (ImageNet-style): a JSON file or mapping from the `cls`
        value (a class id) to a prompt or list of prompts, which becomes the caption; items also
        carry the id as "label" (for `ldm.conditioning.ClassLabels`, DiT).
    shuffle_buffer: samples held for shuffling within each worker's stream.
    max_image_pixels: images with more pixels are dropped as decompression bombs.
    caption_key: the extension of each sample's caption file (`txt`, img2dataset's; some sets
        write `caption` or `text`); null for a set without captions (an unconditional model).
    """

    def __init__(
        self,
        urls,
        num_examples_to_see: int,
        size: int = 512,
        interpolation: str = "bicubic",
        crop: str = "center",
        flip_p: float = 0.0,
        filters: dict | None = None,
        idx_to_prompt=None,
        shuffle_buffer: int = 1000,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        caption_key: str | None = "txt",
    ):
        if caption_key is not None and (not isinstance(caption_key, str) or not caption_key):
            raise ValueError(
                f"caption_key={caption_key!r}: expected the caption file's extension, e.g. txt"
            )
        self.caption_key = caption_key.lstrip(".") if caption_key else None
        self.urls = expand_urls(urls)
        self.infos = object_infos([u for u in self.urls if on_fsspec(u)])  # size, version
        missing = [u for u in self.urls if not self._exists(u)]
        for url in missing:
            logger.warning("shard %s does not exist; left out", url)
        self.urls = [u for u in self.urls if u not in set(missing)]
        if not self.urls:
            raise ValueError(
                f"no shards found for urls={urls!r} ({len(missing)} listed, none exists)"
            )
        super().__init__(
            num_examples_to_see,
            size,
            interpolation,
            crop,
            flip_p,
            filters,
            idx_to_prompt,
            shuffle_buffer,
            max_image_pixels,
        )

    def _exists(self, url: str) -> bool:
        if on_fsspec(url):
            return url in self.infos
        return "://" in url or url.startswith("pipe:") or os.path.exists(url)

    def shard_list(self) -> list[str]:
        return self.urls

    def read_shard(self, url: str):
        from webdataset.gopen import gopen
        from webdataset.tariterators import group_by_keys, tar_file_iterator

        if on_fsspec(url):
            stream = open_cached(url, self.infos.get(url))
        else:
            stream = gopen(url) if "://" in url or url.startswith("pipe:") else open(url, "rb")
        try:
            files = ({**f, "__url__": url} for f in tar_file_iterator(stream))
            for sample in group_by_keys(files):
                image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
                meta = {}
                if "json" in sample:
                    try:
                        meta = json.loads(sample["json"])
                    except ValueError:
                        meta = {}
                # Byte-order marks and legacy encodings as for flat files; what was not clean
                # UTF-8 is counted per epoch (`_batch`).
                text = sample.get(self.caption_key) if self.caption_key else None
                caption, problem = decode_text(text) if text is not None else (None, None)
                caption = caption.strip() if caption is not None else None
                cls = decode_text(sample["cls"])[0].strip() if "cls" in sample else meta.get("cls")
                key = f"{url}:{sample['__key__']}"
                yield {
                    "key": key,
                    "image": image,
                    "caption": caption,
                    "caption_problem": problem,
                    "cls": cls,
                    "meta": meta if isinstance(meta, dict) else {},
                    "files": sorted(k for k in sample if not k.startswith("__")),
                }
        finally:
            stream.close()

    def check_readable(self) -> None:
        """Read the first samples of the first shard (the launcher calls this before the run
        folder exists): ValueError naming `caption_key` when none of them has that file - a set
        whose captions sit under another extension would otherwise train on empty captions."""
        if self.caption_key is None or self.prompts is not None:
            return
        url, seen = self.urls[0], []
        for raw in itertools.islice(self._read_logged(url, Counter()), CAPTION_PROBE):
            if raw["caption"] is not None:
                return
            seen.append(raw["files"])
        if not seen:
            return  # an unreadable first shard is the stream's own warning, and it goes on
        files = sorted({f".{ext}" for files in seen for ext in files})
        raise ValueError(
            f"caption_key={self.caption_key!r}: none of the first {len(seen)} samples of {url} "
            f"has a .{self.caption_key} file (they have {', '.join(files)}); set caption_key to "
            "the extension of the captions, or to null for a set without captions"
        )


class Parquet(ShardStream):
    """Parquet files with encoded image bytes and a caption column (LAION-style exports,
    Hugging Face datasets); each row group is one shard. Needs `pip install pyarrow`.

    paths: file pattern(s) in brace notation.
    image_column: binary column of encoded images, or a struct with a `bytes` field (the
        Hugging Face Image feature).
    caption_column: string column of captions.
    class_column: with `idx_to_prompt`, the column holding the class index.
    num_examples_to_see: samples per epoch over all ranks; default all rows.
    filters: as in WebDataset, on the other columns (`{aesthetic: ">=5"}`).
    Other parameters as in WebDataset.
    """

    def __init__(
        self,
        paths,
        image_column: str = "image",
        caption_column: str = "caption",
        class_column: str = "label",
        num_examples_to_see: int | None = None,
        size: int = 512,
        interpolation: str = "bicubic",
        crop: str = "center",
        flip_p: float = 0.0,
        filters: dict | None = None,
        idx_to_prompt=None,
        shuffle_buffer: int = 1000,
    ):
        parquet = _pyarrow_parquet()
        self.columns = {"image": image_column, "caption": caption_column, "cls": class_column}
        self.row_groups, rows = [], 0
        for path in expand_urls(paths):
            try:
                if on_fsspec(path):  # the footer only, by range requests
                    with _fsspec_open(path) as file:
                        metadata = parquet.ParquetFile(file).metadata
                else:
                    metadata = parquet.ParquetFile(path).metadata
            except (OSError, ValueError) as err:  # pyarrow raises ArrowInvalid (a ValueError)
                logger.warning("parquet file %s unreadable, left out: %s", path, err)
                continue
            # Every file's columns, from the footer just read: a wrong column name would
            # otherwise train every row with an empty caption, or fail later in a worker.
            check_columns(metadata.schema.to_arrow_schema(), path, self.columns, idx_to_prompt)
            self.row_groups += [(path, i) for i in range(metadata.num_row_groups)]
            rows += metadata.num_rows
        if not self.row_groups:
            raise ValueError(f"no readable parquet files for paths={paths!r}")
        super().__init__(
            num_examples_to_see or rows,
            size,
            interpolation,
            crop,
            flip_p,
            filters,
            idx_to_prompt,
            shuffle_buffer,
            DEFAULT_MAX_PIXELS,
        )

    def shard_list(self) -> list[tuple[str, int]]:
        return self.row_groups

    def read_shard(self, shard: tuple[str, int]):
        path, group = shard
        source = open_cached(path) if on_fsspec(path) else contextlib.nullcontext(path)
        with source as opened:
            yield from self._read_row_group(_pyarrow_parquet().ParquetFile(opened), path, group)

    def _read_row_group(self, file, path: str, group: int):
        names = set(file.schema_arrow.names)
        wanted = [c for c in self.columns.values() if c in names]
        wanted += [k.split(".")[0] for k, _, _ in self.filters if k.split(".")[0] in names]
        for index, row in enumerate(
            file.read_row_group(group, columns=sorted(set(wanted))).to_pylist()
        ):
            image = row.get(self.columns["image"])
            if isinstance(image, dict):
                image = image.get("bytes")
            caption, problem = row.get(self.columns["caption"]), None
            if isinstance(caption, bytes):  # a binary caption column: as a .txt file's bytes
                caption, problem = decode_text(caption)
            if caption is not None:  # a BOM kept inside a string column, trailing newlines
                caption = caption.lstrip("\ufeff").strip()
            yield {
                "key": f"{path}[{group}:{index}]",
                "image": image,
                "caption": caption,
                "caption_problem": problem,
                "cls": row.get(self.columns["cls"]),
                "meta": row,
            }


def check_columns(schema, path: str, columns: dict, idx_to_prompt) -> None:
    """ValueError naming the Parquet parameter whose column `path` lacks or holds the wrong type
    for: the image column (encoded bytes, or a struct with `bytes` - the Hugging Face Image
    feature), the caption column (text or bytes) unless class prompts make the captions, and
    then the class column."""
    import pyarrow as pa

    names = ", ".join(schema.names)
    wanted = [("image_column", columns["image"])]
    wanted.append(
        ("class_column", columns["cls"])
        if idx_to_prompt
        else ("caption_column", columns["caption"])
    )
    for key, column in wanted:
        if column not in schema.names:
            hint = " (or give idx_to_prompt for class prompts)" if key == "caption_column" else ""
            raise ValueError(
                f"{key}={column!r}: {path} has no such column (its columns: {names}); set "
                f"{key} to the column holding the {key.split('_')[0]}s{hint}"
            )
    kind = schema.field(columns["image"]).type
    if not (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0)
    ):
        raise ValueError(
            f"image_column={columns['image']!r}: {path} holds {kind} there, expected encoded "
            "image bytes (binary, or a struct with a 'bytes' field)"
        )
    if not idx_to_prompt:
        kind = schema.field(columns["caption"]).type
        if not any(
            test(kind)
            for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary)
        ):
            raise ValueError(
                f"caption_column={columns['caption']!r}: {path} holds {kind} there, expected "
                "text; set caption_column to the column holding the captions"
            )


def _fsspec_open(url: str):
    fs, path = filesystem(url)
    return fs.open(path, "rb")


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError(
            "lun.data.webdataset.Parquet needs pyarrow: pip install pyarrow"
        ) from None
    return parquet
