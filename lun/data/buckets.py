"""Aspect-ratio buckets and the batch sampler that serves them (and plain square sets too).

Aspect-ratio bucketing (NovelAI, "NovelAI Improvements on Stable Diffusion", 2022): instead of
center-cropping every image to a square, each image goes to the bucket - a (width, height) of
about the same area - whose aspect ratio is nearest its own, and every batch is drawn from one
bucket, so batches stack without padding and far less of each image is cropped away.
"""

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("lun.data")


@dataclass(frozen=True)
class BucketSpec:
    """The `buckets:` config of a dataset.

    area: target pixels per image (width * height); default the dataset's `size` squared.
    step: width and height are multiples of this (64 keeps latents divisible by 8 at /8 VAE scale).
    max_aspect: the widest bucket's width / height (and the tallest's height / width).
    """

    area: int
    step: int = 64
    max_aspect: float = 2.0

    @classmethod
    def from_config(cls, config, size: int) -> "BucketSpec":
        """`buckets: true` for the defaults, or a mapping with any of area / step / max_aspect."""
        if config is not True and not isinstance(config, Mapping):
            raise ValueError(
                f"buckets: expected true or a mapping of area, step, max_aspect, got {config!r}"
            )
        config = {} if config is True else dict(config)
        unknown = set(config) - {"area", "step", "max_aspect"}
        if unknown:
            raise ValueError(
                f"buckets: unknown key(s) {sorted(unknown)}; known: area, step, max_aspect"
            )
        config = {key: value for key, value in config.items() if value is not None}
        for key, kind, what in (
            ("area", int | float, "a number of pixels"),  # `area: 1e6` is a float
            ("step", int, "a whole number of pixels"),
            ("max_aspect", int | float, "a number"),
        ):
            value = config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(f"buckets.{key}={value!r}: expected {what}")
        spec = cls(area=int(config.pop("area", 0) or size * size), **config)
        if spec.step <= 0 or spec.max_aspect < 1 or spec.area < spec.step * spec.step:
            raise ValueError(f"buckets: need step > 0, max_aspect >= 1, area >= step^2; got {spec}")
        return spec


def make_buckets(spec: BucketSpec) -> list[tuple[int, int]]:
    """Every (width, height) in multiples of `step`: for each width the tallest height within
    `area`, kept when its aspect ratio is within `max_aspect`; sorted from tallest to widest."""
    buckets = set()
    for width in range(spec.step, spec.area // spec.step + 1, spec.step):
        height = spec.area // width // spec.step * spec.step
        if height >= spec.step and max(width / height, height / width) <= spec.max_aspect:
            buckets.add((width, height))
    side = math.isqrt(spec.area) // spec.step * spec.step  # the square bucket always exists
    buckets.add((side, side))
    return sorted(buckets, key=lambda wh: wh[0] / wh[1])


def assign_buckets(aspects: Sequence[float], buckets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Index of the bucket nearest each width / height ratio, measured in log ratio so that
    2:1 and 1:2 are equally far from 1:1."""
    bucket_log = np.log([w / h for w, h in buckets])  # (K,)
    image_log = np.log(np.asarray(aspects, dtype=np.float64))[:, None]  # (N, 1)
    return np.abs(image_log - bucket_log[None, :]).argmin(axis=1)


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of item indices, each from one group (bucket), for DataLoader(batch_sampler=...).

    - Deterministic per (seed, epoch): every rank computes the same global batch list, without
      communicating, and takes every `world_size`-th batch from `rank`.
    - Every rank gets the same number of batches (the list wraps around to a multiple of
      `world_size`), so no rank waits at the epoch's end for a batch that never comes.
    - Training (`shuffle=True`): items are shuffled within each group and the group's last batch is
      topped up from its start, so every batch is full and every item is seen each epoch; then
      the batches are shuffled. Validation (`shuffle=False`): fixed order, last batch may be short.
    - Resumable mid-epoch: `state_dict()` / `load_state_dict()`; the first epoch after a resume
      skips the batches already consumed (see lun.data.DataModule for how the count is taken).

    groups: group id of every item (all zeros when all items have the same size).
    on_epoch_start: called with the epoch number when an epoch begins (for summaries).
    """

    def __init__(
        self,
        groups: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        on_epoch_start: Callable[[int], None] | None = None,
    ):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                "need batch_size >= 1 and 0 <= rank < world_size, "
                f"got {batch_size}, {rank}, {world_size}"
            )
        groups = np.asarray(groups, dtype=np.int64)
        if groups.size == 0:
            raise ValueError("BucketBatchSampler: no items")
        self.members = [np.flatnonzero(groups == g) for g in np.unique(groups)]
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size, self.on_epoch_start = rank, world_size, on_epoch_start
        self.num_global_batches = sum(math.ceil(len(m) / batch_size) for m in self.members)
        self.epoch = 0
        self.position = 0  # batches of `epoch` handed out on this rank
        self._skip = 0  # batches to skip when `epoch` is iterated (after a resume)
        self._epoch_chosen = True  # the next `begin_epoch` serves `epoch` itself, not epoch + 1

    def __len__(self) -> int:
        return math.ceil(self.num_global_batches / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to serve next (like DistributedSampler.set_epoch)."""
        if epoch != self.epoch:
            self.epoch, self.position, self._skip = epoch, 0, 0
        self._epoch_chosen = True

    def begin_epoch(self) -> None:
        """Called each time a DataLoader starts iterating: serve the chosen epoch (0 at first, the
        resumed one after `load_state_dict`, or the one given to `set_epoch`), else the next."""
        if not self._epoch_chosen:
            self.set_epoch(self.epoch + 1)
        self._epoch_chosen = False

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """The whole epoch's batches before splitting across ranks."""
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for members in self.members:
            if self.shuffle:
                # Top up the last batch from the start of the shuffled group (np.resize repeats).
                count = math.ceil(len(members) / self.batch_size) * self.batch_size
                members = np.resize(rng.permutation(members), count)
            batches += [
                members[i : i + self.batch_size] for i in range(0, len(members), self.batch_size)
            ]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self):
        for _, batch in self.numbered():
            yield batch

    @property
    def start(self) -> tuple[int, int]:
        """(epoch, batches skipped in it) that the next `numbered()` serves from."""
        return self.epoch, self._skip

    def epoch_batches(self, epoch: int, skip: int = 0):
        """This rank's batches of `epoch` after the first `skip`, as (number in the epoch's global
        list, indices); changes nothing (a loader may read ahead into the next epoch with it)."""
        batches = self.global_batches(epoch)
        numbers = range(self.rank, len(self) * self.world_size, self.world_size)
        for number in numbers[skip:]:
            yield number, batches[number % len(batches)].tolist()

    def numbered(self):
        """This rank's batches of the epoch as (number in the epoch's global list, indices)."""
        if self.on_epoch_start is not None:
            self.on_epoch_start(self.epoch)
        skip, self._skip = self._skip, 0
        self.position = skip
        for number, batch in self.epoch_batches(self.epoch, skip):
            self.position += 1
            yield number, batch

    def state_dict(self) -> dict:
        """Where this rank is: epoch, batches handed out in it, and the layout they came from."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.world_size,
            "num_batches": len(self),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped: the next epoch begun skips the consumed batches."""
        if state.get("seed", self.seed) != self.seed:
            logger.warning(
                "resuming the data order with seed %s, saved with %s", self.seed, state["seed"]
            )
        self.epoch, self.position = resume_point(state, len(self), self.world_size)
        self._skip = self.position
        self._epoch_chosen = True


def resume_point(state: dict, num_batches: int, world_size: int) -> tuple[int, int]:
    """(epoch, batches to skip on this rank) from a saved state_dict.

    Ranks take batches round-robin, so after every rank took `position` batches the first
    `position * world_size` global batches are used; that also holds on another number of devices.
    A complete saved epoch resumes at the start of the next one.
    """
    saved_world = int(state.get("world_size", world_size))
    if int(state.get("num_batches", num_batches)) * saved_world != num_batches * world_size:
        logger.warning(
            "the data changed since the checkpoint: the resumed data position is approximate"
        )
    epoch = int(state["epoch"])
    position = int(state["position"]) * saved_world // world_size
    if position >= num_batches:
        return epoch + 1, 0
    return epoch, position
