"""The latent (and text-embedding) cache: its content-addressed keys, its index, and the dataset
that trains from it.

With a frozen VAE and text encoder every epoch encodes the same images and captions again; the
VAE encode alone costs about half a UNet training step at 512 px. `scripts/cache_latents.py`
encodes each item once into sharded `.safetensors` files; training then reads them:

    data:
      target: lun.data.DataModule
      params:
        cache: cache/my-set          # the folder scripts/cache_latents.py wrote
        train: {target: lun.data.local.Local, params: {data_root: ..., size: 512}}

What is stored: per image and bucket size, the VAE posterior's moments (mean and log-variance,
(2C, h, w), in the VAE's own units), so training still draws a new latent from the posterior at
every step (`LatentDiffusion` samples it from the training seed stream, as online encoding does)
- or, with `--sample`, one latent drawn once, as the backbone sees it ((z - shift) * scale, C, h, w). With a
horizontal flip (`flip_p > 0`) both orientations are stored and the flip is drawn per step, as
online. With `--text` and a frozen text encoder, its outputs per caption (`context`).

Keys (content addressing): an entry's name is a hash of everything its value depends on -
the VAE's weights (a hash of its state dict) and kind, the scale factor, the bucket size, crop,
interpolation, orientation and the image file's content hash; for text, the text encoder's
weights and settings and the caption text after the dataset's caption rules. A changed image,
caption or setting changes exactly the affected keys: the next cache run encodes those and
keeps the rest. Training recomputes every item's keys (file size + mtime, then the content hash
where those changed) and refuses a cache with stale entries with one line naming the count and
the command that refreshes it: it never trains on a stale latent, and never falls back to
encoding silently. The cache holds no pickles and no absolute paths (images are named relative
to `data_root`), so the folder can move between machines.

Only center crops are cached (a random crop differs every epoch), and only map-style datasets
(lun.data.local.Local); a stream (WebDataset, Parquet) would need its own index.
"""

import hashlib
import json
import logging
import os
import random
from collections import Counter
from collections.abc import Mapping

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from ldm.util import instantiate_from_config
from lun.contract import LatentModel

logger = logging.getLogger("lun.data")

FORMAT, VERSION, INDEX = "lun-latent-cache", 1, "index.json"
KINDS = ("posterior", "sample")


def hash_json(value) -> str:
    """A short stable hash of a JSON-able value (32 hex digits of SHA-256)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- what a dataset must be to be cached -----------------------------------------------------


def image_settings(dataset) -> dict:
    """The dataset settings every latent depends on (besides its size and orientation)."""
    return {
        "crop": dataset.crop,
        "interpolation": dataset.interpolation,
        "max_pixels": dataset.max_image_pixels,
    }


def check_cacheable(dataset, text: bool = False) -> None:
    """ValueError naming the setting that makes `dataset`'s items impossible to cache."""
    needed = ("item_size", "caption", "crop", "interpolation", "flip_p", "batch_groups")
    if not all(hasattr(dataset, name) for name in needed):
        raise ValueError(
            f"cache: {type(dataset).__name__} cannot be cached (only lun.data.local.Local's "
            "folders and metadata can; train it without a cache)"
        )
    if dataset.crop != "center":
        raise ValueError(
            "crop='random': a cached latent holds one crop, a random crop changes every epoch; "
            "use crop: center with a cache"
        )
    metadata = getattr(dataset, "metadata", None)
    if text and metadata is not None and metadata.reshuffle_tag_p > 0:
        raise ValueError(
            "metadata_params.reshuffle_tag_p > 0: captions change every epoch, their text "
            "embeddings cannot be cached (cache the latents only)"
        )


def latent_key(model: dict, settings: dict, size, flip: bool, image_sha: str) -> str:
    """The name of one latent entry: everything its value depends on."""
    return hash_json(
        {
            "first_stage": model["first_stage"],
            "kind": model["kind"],
            "scale_factor": model["scale_factor"],
            # Only where the first stage has a shift (SD3): older caches' keys stay valid.
            **({"shift_factor": model["shift_factor"]} if model.get("shift_factor") else {}),
            **settings,
            "size": list(size),
            "flip": flip,
            "image": image_sha,
        }
    )


def text_key(model: dict, caption: str) -> str:
    return hash_json({"text": model["text"], "caption": caption})


# --- the index --------------------------------------------------------------------------------


def read_index(cache_dir: str, missing_ok: bool = False) -> dict | None:
    """The cache's index.json; ValueError naming the folder when it is missing or not ours."""
    path = os.path.join(cache_dir, INDEX)
    if not os.path.isfile(path):
        if missing_ok:
            return None
        what = "has no index.json" if os.path.isdir(cache_dir) else "does not exist"
        raise ValueError(
            f"cache={cache_dir!r} {what}: make it with python scripts/cache_latents.py "
            f"--base <configs> --out {cache_dir}"
        )
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
    except (OSError, ValueError) as err:
        raise ValueError(f"cache={cache_dir!r}: {INDEX} is unreadable ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"cache={cache_dir!r}: {INDEX} is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise ValueError(
            f"cache={cache_dir!r}: index version {index.get('version')}, this code reads "
            f"{VERSION}; rebuild it with scripts/cache_latents.py"
        )
    return index


def write_index(cache_dir: str, index: dict) -> None:
    """Write index.json atomically (temp file + rename): a reader sees the old or the new one."""
    path = os.path.join(cache_dir, INDEX)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as file:
        json.dump(index, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def current_file(root: str, rel: str, recorded: dict | None) -> dict:
    """{bytes, mtime_ns, sha256} of the image now; the content is hashed only when its size or
    mtime differ from `recorded` (the index's record of it), which is then trusted."""
    stat = os.stat(os.path.join(root, rel))
    now = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if recorded and all(recorded.get(k) == v for k, v in now.items()):
        return {**now, "sha256": recorded["sha256"]}
    return {**now, "sha256": file_sha256(os.path.join(root, rel))}


def item_keys(dataset, index: int, model: dict, file: dict, text: bool) -> dict:
    """The keys item `index` needs: latent, latent_flip (when flips are on), text."""
    size, settings = dataset.item_size(index), image_settings(dataset)
    keys = {"latent": latent_key(model, settings, size, False, file["sha256"])}
    keys["latent_flip"] = (
        latent_key(model, settings, size, True, file["sha256"]) if dataset.flip_p > 0 else None
    )
    keys["text"] = text_key(model, dataset.caption(index)) if text else None
    return keys


# --- training from the cache ------------------------------------------------------------------


class CachedLatents(Dataset):
    """Items {"latent", "caption"[, "context": {field: tensor}]} of a dataset, from its cache.

    Everything that orders the data is the dataset's own - its length, `batch_groups` (buckets),
    the flips drawn under the DataModule's per-batch seeded streams - so the batch order, the
    per-rank bucket balance and an exact mid-epoch resume are those of the uncached run.

    dataset: the dataset's {target, params} (or the dataset itself), as it was cached.
    cache: the folder scripts/cache_latents.py wrote.
    text: read the cached text-encoder outputs when the cache has them (and the model's text
        encoder is frozen and the one they were made with; see `check_model`).
    """

    def __init__(self, dataset, cache: str, text: bool = True):
        if isinstance(dataset, Mapping):
            dataset = instantiate_from_config(dataset)
        self.dataset, self.cache_dir = dataset, str(cache)
        self.index = read_index(self.cache_dir)
        self.model = self.index["model"]
        self.text = bool(text and self.model["text"])
        check_cacheable(dataset, self.text)
        self.batch_groups = dataset.batch_groups
        self.bucket_sizes = getattr(dataset, "bucket_sizes", None)
        self.bad_input = getattr(dataset, "bad_input", None)
        self.keys, self.substitute = self._check_entries()
        self.text_fields = self.index.get("text_fields", [])
        self._files = {}  # shard name -> safe_open handle, opened lazily in each process
        logger.info(
            "training from latent cache %s (%d entries, %d items%s)",
            self.cache_dir,
            len(self.index["entries"]),
            len(dataset),
            ", text encoder outputs cached" if self.text else "",
        )

    def _check_entries(self) -> tuple[list, dict]:
        """Every item's keys, recomputed from its file and caption now; ValueError counting the
        stale ones. Items whose image failed when cached (unchanged since) are served by the next
        cached item of their bucket, as Local serves the next readable one."""
        dataset, entries = self.dataset, self.index["entries"]
        records = {record["image"]: record for record in self.index["items"]}
        keys, stale, failed = [], Counter(), []
        for i in range(len(dataset)):
            rel = dataset.image_name(i)
            record = records.get(rel)
            if record is None:
                stale["new image"] += 1
                keys.append(None)
                continue
            file = current_file(dataset.data_root, rel, record)
            mine = item_keys(dataset, i, self.model, file, self.text)
            if record.get("failed") and file["sha256"] == record["sha256"]:
                failed.append(i)
                keys.append(None)
                continue
            missing = [name for name, key in mine.items() if key is not None and key not in entries]
            if missing:
                if file["sha256"] != record["sha256"]:
                    stale["image changed"] += 1
                elif missing == ["text"]:
                    stale["caption changed"] += 1
                else:
                    stale["settings changed"] += 1
            keys.append(mine)
        if stale:
            count = sum(stale.values())
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(stale.items()))
            made_with = " ".join(self.index.get("made_with") or ["<configs>"])
            raise ValueError(
                f"cache={self.cache_dir!r}: {count} of {len(dataset)} items are not cached as "
                f"this config needs them ({why}); refresh with: python scripts/cache_latents.py "
                f"--base {made_with} --out {self.cache_dir}"
            )
        return keys, self._substitutes(keys, failed)

    def _substitutes(self, keys: list, failed: list[int]) -> dict[int, int]:
        groups = self.batch_groups
        usable = [i for i in range(len(keys)) if keys[i] is not None]
        if not usable:
            raise ValueError(f"cache={self.cache_dir!r}: no item has a cached latent")
        substitute = {}
        for i in failed:
            same = [j for j in usable if groups[j] == groups[i]] or usable
            substitute[i] = next((j for j in same if j > i), same[0])
        if failed:
            logger.warning(
                "cache %s: %d images could not be read when cached; their batches use the next "
                "cached item of their bucket",
                self.cache_dir,
                len(failed),
            )
        return substitute

    def check_model(self, model: LatentModel) -> None:
        """ValueError unless `model`'s VAE, scale factor (and frozen text encoder, when its
        outputs are read) are the ones the cache was made with. The launcher calls it before
        the run folder exists. A trainable text encoder ignores the cached text."""
        if self.text and not model.caption_conditioning_frozen:
            self.text = False
            logger.info("cache %s: the text encoder trains, cached text unused", self.cache_dir)
        found = model.cache_fingerprint(text=self.text)
        checks = [("first_stage", "first-stage (VAE) weights")]
        checks += [("text", "text encoder")] if self.text else []
        for name in ("scale_factor", "shift_factor"):  # before the weights: the line names it
            if float(found.get(name, 0.0)) != float(self.model.get(name, 0.0)):
                checks = [(name, name)]
        for name, what in checks:
            if found.get(name) != self.model.get(name):
                made_with = " ".join(self.index.get("made_with") or ["<configs>"])
                raise ValueError(
                    f"cache={self.cache_dir!r}: all {len(self)} items were cached with another "
                    f"{what}; refresh with: python scripts/cache_latents.py --base {made_with} "
                    f"--out {self.cache_dir}"
                )

    def check_readable(self) -> None:
        """Every shard the index names is there (what the launcher checks before a run)."""
        for shard in sorted(set(self.index["entries"].values())):
            if not os.path.isfile(os.path.join(self.cache_dir, shard)):
                raise ValueError(
                    f"cache={self.cache_dir!r}: shard {shard} is missing; rebuild with "
                    "python scripts/cache_latents.py"
                )

    def __len__(self) -> int:
        return len(self.dataset)

    def item_size(self, index: int) -> tuple[int, int]:
        return self.dataset.item_size(index)

    def _tensor(self, key: str, name: str | None = None) -> torch.Tensor:
        shard = self.index["entries"][key]
        handle = self._files.get(shard)
        if handle is None:
            handle = self._files[shard] = safe_open(
                os.path.join(self.cache_dir, shard), framework="pt"
            )
        return handle.get_tensor(key if name is None else f"{key}.{name}")

    def __getitem__(self, index: int) -> dict:
        keys = self.keys[self.substitute.get(index, index)]
        # The flip is drawn as Local draws it (lun.data.images.resize_crop), from the streams
        # the DataModule seeds per batch: a cached run flips the same items as an online one.
        flip_p = self.dataset.flip_p
        flip = flip_p > 0 and random.random() < flip_p
        item = {"latent": self._tensor(keys["latent_flip" if flip else "latent"])}
        item["caption"] = self.dataset.caption(index)
        if self.text:
            item["context"] = {f: self._tensor(keys["text"], f) for f in self.text_fields}
        return item

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}  # open files stay in their process


def check_cached_data(data, model: LatentModel) -> None:
    """The launcher's check that every cached dataset of `data` matches `model` (ValueError)."""
    for dataset in getattr(data, "datasets", {}).values():
        if isinstance(dataset, CachedLatents):
            dataset.check_model(model)
