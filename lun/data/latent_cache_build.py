"""Building the latent cache (scripts/cache_latents.py): plan what is missing, encode it shard by
shard, then write the index.

- Plan: every item's keys are computed (lun.data.latent_cache); what the previous index already
  holds is kept, the rest becomes work units (one image - both orientations when flips are on -
  or one caption), sorted by bucket size and cut into shards of `shard_size` units. A shard's
  file name is a hash of its units' keys, so the same missing set always plans the same shards.
- Encode: each rank takes a contiguous range of the shards (torchrun / WORLD_SIZE + RANK); a
  shard is written atomically (temp file + rename), so after a crash the shards on disk are
  whole and a rerun - which plans the same shards, since the index is only written at the end -
  encodes only the others.
- Finish: whichever rank sees every planned shard on disk writes the index (atomically; the
  same content from any rank) and deletes the shards nothing refers to any more.
"""

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader
from tqdm import tqdm

from ldm.checkpoint import save_safetensors
from lun.contract import LatentModel
from lun.data.images import ImageError, load_image_tensor
from lun.data.latent_cache import (
    FORMAT,
    VERSION,
    current_file,
    hash_json,
    image_settings,
    item_keys,
    write_index,
)

logger = logging.getLogger("lun.data")
SHARD_PREFIX, SHARD_SUFFIX = "shard-", ".safetensors"


@dataclass
class Unit:
    """One piece of work: an image (its latent keys: plain, flipped) or a caption (its key)."""

    kind: str  # "image" or "text"
    item: int
    keys: list[str]
    size: tuple[int, int] | None = None


@dataclass
class Plan:
    """What one cache run does: the new index's items and the shards to write."""

    cache_dir: str
    model: dict
    items: list[dict]
    kept: dict[str, str]  # entries of the previous index still needed: key -> shard
    shards: list[tuple[str, list[Unit]]]  # (file name, units) to encode
    reasons: Counter = field(default_factory=Counter)
    text_fields: list[str] = field(default_factory=list)
    made_with: list[str] = field(default_factory=list)

    def to_encode(self, kind: str) -> int:
        """Images ("image") or distinct captions ("text") this run encodes."""
        return sum(unit.kind == kind for _, units in self.shards for unit in units)

    def summary(self) -> str:
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items())) or "nothing changed"
        images, texts = self.to_encode("image"), self.to_encode("text")
        return (
            f"cache {self.cache_dir}: {len(self.items)} items; {len(self.kept)} entries valid, "
            f"{images} images and {texts} captions to encode in {len(self.shards)} shards ({why})"
        )


def make_plan(
    dataset, model: dict, previous: dict | None, text: bool, cache_dir: str, shard_size: int
) -> Plan:
    """Keys of every item now, against the previous index (None: a new cache)."""
    previous = previous or {"entries": {}, "items": [], "model": {}}
    entries = previous["entries"]
    records = {record["image"]: record for record in previous["items"]}
    items, kept, units, reasons, seen_text = [], {}, [], Counter(), set()
    for i in range(len(dataset)):
        rel = dataset.image_name(i)
        before = records.get(rel)
        file = current_file(dataset.data_root, rel, before)
        keys = item_keys(dataset, i, model, file, text)
        size = tuple(dataset.item_size(i))
        items.append({"image": rel, **file, "size": list(size), **keys})
        image_keys = [k for k in (keys["latent"], keys["latent_flip"]) if k is not None]
        if all(k in entries for k in image_keys):
            kept.update((k, entries[k]) for k in image_keys)
        else:
            units.append(Unit("image", i, image_keys, size))
            if before is None:
                reasons["new"] += 1
            elif before["sha256"] != file["sha256"]:
                reasons["images changed"] += 1
            elif before.get("failed"):
                reasons["retried (unreadable before)"] += 1
            else:
                reasons["settings changed"] += 1
        key = keys["text"]
        if key is not None and key not in seen_text:
            seen_text.add(key)
            if key in entries:
                kept[key] = entries[key]
            else:
                units.append(Unit("text", i, [key]))
                if before is None:
                    reasons["captions new"] += 1
                elif previous["model"].get("text") != model["text"]:
                    reasons["text encoder changed"] += 1
                else:
                    reasons["captions changed"] += 1
    # Same-size images next to each other: batches within a shard share a size.
    units.sort(key=lambda u: (u.kind, u.size or (0, 0), u.item))
    shards = []
    for start in range(0, len(units), shard_size):
        chunk = units[start : start + shard_size]
        name = SHARD_PREFIX + hash_json([u.keys for u in chunk])[:20] + SHARD_SUFFIX
        shards.append((name, chunk))
    return Plan(cache_dir, model, items, kept, shards, reasons)


def rank_shards(plan: Plan, rank: int, world_size: int) -> list[tuple[str, list[Unit]]]:
    """This rank's contiguous range of the planned shards."""
    ranges = np.array_split(np.arange(len(plan.shards)), world_size)
    return [plan.shards[i] for i in ranges[rank]]


class ImageBatches(torch.utils.data.Dataset):
    """(shard number, units, images (B, 3, H, W), failures) per batch: what DataLoader workers
    decode while the main process encodes (the JPEG draft decoding of lun.data.images)."""

    def __init__(self, dataset, batches: list[tuple[int, list[Unit]]]):
        self.dataset, self.batches = dataset, batches
        self.settings = image_settings(dataset)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, number: int):
        shard, units = self.batches[number]
        good, images, failed = [], [], []
        for unit in units:
            path = os.path.join(self.dataset.data_root, self.dataset.image_name(unit.item))
            try:
                images.append(
                    load_image_tensor(
                        path,
                        unit.size,
                        self.settings["interpolation"],
                        "center",
                        max_pixels=self.settings["max_pixels"],
                    )
                )
                good.append(unit)
            except (ImageError, OSError) as err:
                failed.append((unit.item, str(err).splitlines()[0]))
        return shard, good, torch.stack(images) if images else None, failed


def _as_is(batch):
    return batch


def _batches(shards, batch_size: int) -> list[tuple[int, list[Unit]]]:
    batches = []
    for number, (_, units) in enumerate(shards):
        images = [u for u in units if u.kind == "image"]
        run = []
        for unit in images:
            if run and (len(run) == batch_size or run[-1].size != unit.size):
                batches.append((number, run))
                run = []
            run.append(unit)
        if run:
            batches.append((number, run))
    return batches


@torch.no_grad()
def encode_images(model: LatentModel, images: torch.Tensor, units: list[Unit], kind: str) -> dict:
    """The entries of a batch of images: posterior moments (2C, h, w) in the VAE's units, or
    (`kind` "sample") one latent drawn with a generator seeded by its key, as model latents."""
    out = {}
    orientations = [images, images.flip(-1)] if len(units[0].keys) == 2 else [images]
    for side, x in enumerate(orientations):
        moments = model.first_stage_moments(x)
        for j, unit in enumerate(units):
            key = unit.keys[side]
            if kind == "posterior":
                out[key] = moments[j].cpu().clone()
            else:  # reproducible on any rank and after a resume: seeded by the entry's key
                generator = torch.Generator(moments.device).manual_seed(int(key[:15], 16))
                mean, logvar = moments[j].chunk(2)
                noise = torch.randn(mean.shape, generator=generator, device=mean.device)
                z = mean + torch.exp(0.5 * logvar) * noise
                out[key] = model.to_model_latents(z).cpu().clone()
    return out


@torch.no_grad()
def encode_texts(model: LatentModel, dataset, units: list[Unit]) -> tuple[dict, list[str]]:
    """The conditioning fields (crossattn, ...) of the units' captions, as `{key}.{field}`."""
    captions = [dataset.caption(u.item) for u in units]
    cond = model.encode_captions(captions)
    out = {}
    for field_name, value in cond.items():
        for j, unit in enumerate(units):
            out[f"{unit.keys[0]}.{field_name}"] = value[j].float().cpu().clone()
    return out, sorted(cond)


def build_shards(
    plan: Plan,
    dataset,
    model: LatentModel,
    rank: int,
    world_size: int,
    batch_size: int,
    workers: int,
) -> None:
    """Encode and write this rank's shards that are not on disk yet."""
    mine = [
        (name, units)
        for name, units in rank_shards(plan, rank, world_size)
        if not os.path.isfile(os.path.join(plan.cache_dir, name))
    ]
    images = sum(u.kind == "image" for _, units in mine for u in units)
    bar = tqdm(total=images, unit="img", desc=f"rank {rank}" if world_size > 1 else "cache")
    bar.set_postfix_str(f"{len(mine)} shards")
    start = time.perf_counter()
    loader = DataLoader(
        ImageBatches(dataset, _batches(mine, batch_size)),
        batch_size=None,
        num_workers=workers,
        collate_fn=_as_is,
    )
    pending = {number: {} for number in range(len(mine))}
    failures = {number: [] for number in range(len(mine))}
    batches = iter(loader)
    batch = next(batches, None)
    for number, (name, units) in enumerate(mine):
        while batch is not None and batch[0] == number:
            _, good, pixels, failed = batch
            failures[number] += [[dataset.image_name(i), why] for i, why in failed]
            if good:
                pending[number].update(encode_images(model, pixels, good, plan.model["kind"]))
            bar.update(len(good) + len(failed))
            batch = next(batches, None)
        texts = [u for u in units if u.kind == "text"]
        for at in range(0, len(texts), batch_size):
            tensors, fields = encode_texts(model, dataset, texts[at : at + batch_size])
            pending[number].update(tensors)
        metadata = {"format": FORMAT, "failed": json.dumps(failures[number])}
        save_safetensors(pending.pop(number), os.path.join(plan.cache_dir, name), metadata=metadata)
    bar.close()
    if mine:
        seconds = time.perf_counter() - start
        logger.info(
            "rank %d: %d images in %.1f s (%.2f img/s)", rank, images, seconds, images / seconds
        )


def finish(plan: Plan) -> bool:
    """Write the index when every planned shard is on disk (False: others still missing)."""
    folder = plan.cache_dir
    if not all(os.path.isfile(os.path.join(folder, name)) for name, _ in plan.shards):
        return False
    entries, failed = dict(plan.kept), {}
    for name, units in plan.shards:
        with safe_open(os.path.join(folder, name), framework="pt") as shard:
            written = {n.split(".")[0] for n in shard.keys()}  # text entries: `{key}.{field}`
            failed.update(json.loads((shard.metadata() or {}).get("failed", "[]")))
        for unit in units:
            entries.update((key, name) for key in unit.keys if key in written)
    items = []
    for record in plan.items:
        record = dict(record)
        if record["image"] in failed:
            record["failed"] = failed[record["image"]]
        items.append(record)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "model": plan.model,
        "items": items,
        "entries": entries,
        "text_fields": plan.text_fields,
        "made_with": plan.made_with,
    }
    write_index(folder, index)
    used = set(entries.values())
    removed = 0
    for stale in os.listdir(folder):
        # Shards no entry refers to any more, and what a killed writer left (`*.tmp`): every
        # planned shard is on disk, so no rank is writing one now.
        unused = stale.endswith(SHARD_SUFFIX) and stale not in used
        if stale.startswith(SHARD_PREFIX) and (unused or stale.endswith(SHARD_SUFFIX + ".tmp")):
            try:
                os.remove(os.path.join(folder, stale))
                removed += 1
            except FileNotFoundError:  # another rank finished at the same moment
                pass
    # In the summary's terms: of its images to encode, the unreadable ones are left out (the
    # index lists them); an entry is one latent (two per image with flips) or one caption.
    images = plan.to_encode("image")
    logger.info(
        "cache %s: encoded %d of %d images (%d unreadable, left out) and %d captions; "
        "index written: %d entries (%d kept, %d new) in %d shards%s",
        folder,
        images - len(failed),
        images,
        len(failed),
        plan.to_encode("text"),
        len(entries),
        len(plan.kept),
        len(entries) - len(plan.kept),
        len(used),
        f", {removed} unused shards removed" if removed else "",
    )
    if failed:  # named, not only counted: the user can repair or remove them and rerun
        named = ", ".join(f"{path} ({why})" for path, why in list(failed.items())[:5])
        logger.warning(
            "cache %s: %d images could not be read (training serves the next cached item of "
            "their bucket instead): %s%s",
            folder,
            len(failed),
            named,
            ", ..." if len(failed) > 5 else "",
        )
    return True
