"""lun.data.DataModule: datasets from config -> DataLoaders, seeded, sharded and resumable.

    data:
      target: lun.data.DataModule
      params:
        batch_size: 4
        num_workers: 2
        train:
          target: lun.data.local.Local
          params: {data_root: data/shapes, size: 64}
        validation:                       # optional
          target: lun.data.local.Local
          params: {data_root: data/shapes_val, size: 64}
          batch_size: 8                   # per-split overrides of the loader settings

For the launcher:

- Ranks: this module splits batches across ranks itself (every rank computes the same epoch order
  from (seed, epoch) and takes its share), so the Trainer must be built with
  `use_distributed_sampler=False`; under DDP with the default True it stops with that advice.
- Resume: `trainer.fit(model, datamodule=dm, ckpt_path=...)` is all. Lightning stores
  `DataModule.state_dict()` in every checkpoint - the epoch being served and the batches of it
  this rank consumed (Lightning's own `batch_progress.current.processed`, which unlike a count in
  the loader is not inflated by prefetching) - and hands it back to `load_state_dict()` before the
  loaders are built; the resumed epoch then skips exactly those batches.
- Seeds: the data order comes from `seed` (default: the seed given to `seed_everything`). Each
  batch is loaded under `random`, numpy and torch streams seeded by (seed, epoch, the batch's
  number in the epoch) - `lun.rng.seeded` - so its flips and crops are the same on any rank, with
  any number of workers, loaded ahead or not, and after a resume. The training process's own
  streams are left as they were (what `lun.callbacks.rng_state` saves and restores).
  Validation and test items are loaded each under streams seeded by (seed, the item's index) and
  carry that index (`ldm.validation.ITEM_KEY`): every pass sees the same items with the same
  timesteps and noise, whatever the batch size and number of devices.
"""

import difflib
import functools
import logging
import os
import warnings

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ldm.config_errors import is_count
from ldm.util import instantiate_from_config
from ldm.validation import ITEM_KEY
from lun.config import ConfigError
from lun.data.buckets import BucketBatchSampler
from lun.data.held_out import check_held_out
from lun.rng import seeded

logger = logging.getLogger("lun.data")

LOADER_KEYS = ("batch_size", "num_workers", "persistent_workers", "pin_memory")
# What each loader setting may be: key -> (test, allowed), checked before any loader exists.
LOADER_VALUES = {
    "batch_size": (lambda v: is_count(v, 1), "a whole number >= 1"),
    "num_workers": (lambda v: is_count(v, 0), "a whole number >= 0"),
    "persistent_workers": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "pin_memory": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
}


def check_loader_settings(key: str, settings: dict, split: bool = False) -> None:
    """One-line ConfigError naming `key.<name>` for an unknown (in a split) or invalid setting."""
    if split:
        unknown = sorted(set(settings) - {"target", "params", *LOADER_KEYS})
        if unknown:
            near = difflib.get_close_matches(unknown[0], LOADER_KEYS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(
                f"{key}.{unknown[0]}: not a loader setting (unknown key '{unknown[0]}'; "
                f"loader keys: {', '.join(LOADER_KEYS)}){hint}"
            )
    for name, (valid, allowed) in LOADER_VALUES.items():
        if name in settings and not valid(settings[name]):
            raise ConfigError(f"{key}.{name}={settings[name]!r}: expected {allowed}")


class KeyedBatches(Sampler):
    """The batches of a BucketBatchSampler as (key, indices): the key (seed, epoch, number of
    the batch in the epoch's global list) names a batch the same way on every rank, in every
    worker and after a resume.

    endless: go on into the next epochs after this one (for EpochLoader's `read_ahead`); the
    order of each epoch is the same, its batches only start loading earlier.
    """

    def __init__(self, ordering: BucketBatchSampler, endless: bool = False):
        self.ordering, self.endless = ordering, endless

    def __len__(self) -> int:
        return len(self.ordering)

    def __iter__(self):
        if not self.endless:
            for number, batch in self.ordering.numbered():
                yield (self.ordering.seed, self.ordering.epoch, number), batch
            return
        epoch, skip = self.ordering.start
        while True:
            for number, batch in self.ordering.epoch_batches(epoch, skip):
                yield (self.ordering.seed, epoch, number), batch
            epoch, skip = epoch + 1, 0


class SeededItems(Dataset):
    """A map-style dataset loaded a batch at a time (from KeyedBatches), each batch under streams
    seeded by its key: its random draws (flips, crops, tag shuffles) depend on which batch it is,
    not on which process loads it or what was loaded before.

    held_out: a validation or test set - each item is loaded under streams seeded by (seed, its
    index) instead, the same at every pass whatever the batch size and number of devices, and
    carries its index as `ldm.validation.ITEM_KEY`, which fixes its timesteps and noise.
    """

    def __init__(self, dataset: Dataset, held_out: bool = False):
        self.dataset, self.held_out = dataset, held_out

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keyed_batch: tuple) -> list:
        key, indices = keyed_batch
        if not self.held_out:
            with seeded(key):
                return [self.dataset[i] for i in indices]
        items = []
        for i in indices:
            with seeded((key[0], i)):
                item = self.dataset[i]
            items.append({**item, ITEM_KEY: i} if isinstance(item, dict) else item)
        return items


class EpochLoader(DataLoader):
    """A DataLoader that tells its batch sampler or stream when an epoch begins.

    Lightning only calls `set_epoch` on `sampler` attributes, and a stream dataset has none, so
    each `iter()` - Lightning makes exactly one per epoch - begins the next epoch (or the
    resumed one) on the object that orders the data.

    read_ahead (a map-style training set with persistent workers): Lightning makes the next
    epoch's `iter()` only when that epoch starts, so its first batches would wait for the
    workers at every boundary (a 20-image set has one every 5 steps). Instead one iterator of
    the workers spans the epochs (its batch sampler, KeyedBatches(endless=True), goes on into the
    next epoch), and they load the next epoch's first batches while this epoch's last ones
    train. Each `iter()` serves its epoch's batches from that iterator; when the iterator stands
    elsewhere (the first epoch, a resume, an epoch cut short by `limit_train_batches`) it is
    started again at the right batch (torch's `_reset` drops what it had read ahead).
    """

    def __init__(self, *args, epochs, read_ahead: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.epochs, self.read_ahead = epochs, read_ahead and self.persistent_workers
        self._next_batch: tuple[int, int] | None = None  # (epoch, batch) the iterator yields next

    def __iter__(self):
        self.epochs.begin_epoch()
        if not self.read_ahead:
            return super().__iter__()
        return self._serve_epoch()

    def _serve_epoch(self):
        ordering = self.epochs
        if self._iterator is None or self._next_batch != ordering.start:
            self._next_batch = None
            super().__iter__()  # starts (or resets) the persistent iterator at ordering.start
        batches = self._iterator
        for _ in ordering.numbered():  # the epoch's bookkeeping: its start hook, the position
            epoch, position = ordering.epoch, ordering.position
            self._next_batch = (epoch, position) if position < len(ordering) else (epoch + 1, 0)
            yield next(batches)


def _warn_small_groups(split: str, dataset, groups, batch_size: int) -> None:
    """One line when a training set (or one of its buckets) holds fewer images than a batch: the
    sampler fills such batches by repeating their images (lun.data.buckets), which weights them
    more than the rest - a choice the user should see, not find out."""
    groups = np.zeros(len(dataset), dtype=np.int64) if groups is None else np.asarray(groups)
    counts = np.bincount(groups)
    small = [(g, int(n)) for g, n in enumerate(counts) if 0 < n < batch_size]
    if not small:
        return
    sizes = getattr(dataset, "bucket_sizes", None)
    if len(counts) == 1 or sizes is None:
        what = f"{len(dataset)} images, fewer than a batch of {batch_size}"
    else:
        named = ", ".join(f"{sizes[g][0]}x{sizes[g][1]}: {n}" for g, n in small[:5])
        what = (
            f"{len(small)} of {int((counts > 0).sum())} buckets hold fewer images than a batch "
            f"of {batch_size} ({named}{', ...' if len(small) > 5 else ''})"
        )
    logger.warning(
        "data.%s: %s; their batches are filled by repeating those images (scripts/"
        "inspect_data.py's Buckets section counts the repeats)",
        split,
        what,
    )


def _summarize_epoch(dataset, epoch: int) -> None:
    if epoch > 0 and getattr(dataset, "bad_input", None) is not None:
        dataset.bad_input.summarize_epoch(f"after epoch {epoch - 1}")


class DataModule(L.LightningDataModule):
    """Training (and optional validation) data from `target:`/`params:` dataset configs.

    Batches are {"image": float32 (B, 3, H, W) in [-1, 1], "caption": list[str]}.

    train: {target, params} of the training dataset (lun.data.local.Local,
        lun.data.webdataset.WebDataset, lun.data.webdataset.Parquet, or any map-style dataset
        of such items); may also hold per-split loader settings (batch_size, num_workers, ...).
    validation: the same for validation; optional.
    test: the same for `trainer.test` after training; optional.
    batch_size: images per batch on each device.
    num_workers: DataLoader worker processes per device.
    persistent_workers: keep workers alive between epochs; default true when num_workers > 0.
    pin_memory: page-locked batches for faster, asynchronous host-to-device copies; default
        (null) true when the trainer runs on an accelerator (CUDA, ROCm, XPU: pinning is what
        lets the copy overlap the step), false on the CPU and on MPS (shared memory).
    seed: seed of the data order; default the seed given to seed_everything, else 0.
    cache: a folder written by scripts/cache_latents.py: training then reads the training set's
        VAE latents (and text-encoder outputs) from it instead of its images
        (lun.data.latent_cache.CachedLatents); the order and resume are unchanged.
    """

    def __init__(
        self,
        train: dict,
        validation: dict | None = None,
        test: dict | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        persistent_workers: bool | None = None,
        pin_memory: bool | None = None,
        seed: int | None = None,
        cache: str | None = None,
    ):
        super().__init__()
        self.cache = cache
        self.configs = {"train": train, "validation": validation, "test": test}
        self.defaults = {
            "batch_size": batch_size,
            "num_workers": num_workers,
            "persistent_workers": persistent_workers,
            "pin_memory": pin_memory,
        }
        self.seed = seed
        self.datasets = {}
        self.orderings = {}  # split -> the BucketBatchSampler or stream that orders its batches
        self._resume = {}
        # As LightningDataModule.from_datasets does: a split's loader hook exists only when the
        # split is configured, so Lightning runs (and warns about) no loop for a missing one.
        if validation is not None:
            self.val_dataloader = functools.partial(self._loader, "validation", train=False)
        if test is not None:
            self.test_dataloader = functools.partial(self._loader, "test", train=False)

    def setup(self, stage: str | None = None) -> None:
        splits = {
            "fit": ("train", "validation"),
            "validate": ("validation",),
            "test": ("test",),
            None: ("train", "validation", "test"),
        }
        for split in splits.get(stage, ()):
            if self.configs[split] is not None and split not in self.datasets:
                self.datasets[split] = instantiate_from_config(self.configs[split])
                from lun.data.counts import log_counts  # the report's counts, one a line

                log_counts(f"data.{split}", self.datasets[split])
                if split == "train" and self.cache:
                    from lun.data.latent_cache import CachedLatents

                    self.datasets[split] = CachedLatents(self.datasets[split], self.cache)
                # When the second of the two is built, whichever it is (lun.trainer builds
                # validation first, Lightning's `fit` train first).
                other = {"train": "validation", "validation": "train"}.get(split)
                if other in self.datasets:
                    check_held_out(self.datasets["train"], self.datasets["validation"])

    def batch_size(self, split: str = "train") -> int:
        """Images per batch on each device for `split` (its own setting, else the default)."""
        return self._settings(split)["batch_size"]

    def _settings(self, split: str) -> dict:
        config = self.configs[split]
        check_loader_settings(f"data.params.{split}", config, split=True)
        settings = {key: config.get(key, self.defaults[key]) for key in LOADER_KEYS}
        if settings["persistent_workers"] is None:
            settings["persistent_workers"] = settings["num_workers"] > 0
        settings["persistent_workers"] = bool(
            settings["persistent_workers"] and settings["num_workers"] > 0
        )
        if settings["pin_memory"] is None:
            # Page-locked batches on an accelerator: its host -> device copy can then run
            # asynchronously, beside the step. Not on the CPU (nothing to copy) nor on Apple's
            # MPS (memory shared with the host; torch cannot pin for it).
            settings["pin_memory"] = self._device_type() not in (None, "cpu", "mps")
        return settings

    def _device_type(self) -> str | None:
        """The type of the device the trainer trains on (None without a trainer)."""
        trainer = self.trainer
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        return getattr(getattr(strategy, "root_device", None), "type", None)

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            connector = getattr(trainer, "_accelerator_connector", None)
            if trainer.world_size > 1 and getattr(connector, "use_distributed_sampler", False):
                raise ValueError(
                    "lun.data.DataModule splits batches across ranks itself: build the Trainer "
                    "with use_distributed_sampler=False "
                    "(lightning.trainer.use_distributed_sampler: false)"
                )
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.datasets:
            self.setup({"train": "fit", "validation": "validate", "test": "test"}[split])
        dataset, settings = self.datasets[split], self._settings(split)
        rank, world_size = self._rank_and_world_size()
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        loader_args = {
            "num_workers": settings["num_workers"],
            "persistent_workers": settings["persistent_workers"],
            "pin_memory": settings["pin_memory"],
            # Each epoch's iterator draws its workers' base seed from this generator. By default
            # it is torch's global one, which the training step draws from; a run resumed at an
            # epoch's end starts the next epoch's iterator before its streams are restored, and
            # would then miss the draw that the uninterrupted run made.
            "generator": torch.Generator().manual_seed(seed),
        }
        if isinstance(dataset, IterableDataset):
            if not hasattr(dataset, "configure"):
                raise TypeError(
                    f"{type(dataset).__name__} is an IterableDataset without rank sharding; "
                    "use lun.data.webdataset.WebDataset / Parquet, or a map-style dataset"
                )
            dataset.configure(
                settings["batch_size"], shuffle=train, seed=seed, rank=rank, world_size=world_size
            )
            ordering = dataset
            # Each worker of our streams has its own quota, so their __len__ is exact.
            warnings.filterwarnings(
                "ignore", message="Your `IterableDataset` has `__len__` defined"
            )
            loader = EpochLoader(dataset, batch_size=None, epochs=ordering, **loader_args)
        else:
            groups = getattr(dataset, "batch_groups", None)
            if train:
                _warn_small_groups(split, dataset, groups, settings["batch_size"])
            ordering = BucketBatchSampler(
                np.zeros(len(dataset), dtype=np.int64) if groups is None else groups,
                settings["batch_size"],
                shuffle=train,
                seed=seed,
                rank=rank,
                world_size=world_size,
                on_epoch_start=functools.partial(_summarize_epoch, dataset) if train else None,
            )
            read_ahead = train and settings["persistent_workers"]
            loader = EpochLoader(
                SeededItems(dataset, held_out=not train),
                batch_sampler=KeyedBatches(ordering, endless=read_ahead),
                collate_fn=getattr(dataset, "collate", None),  # its own (DreamBooth's pairs)
                epochs=ordering,
                read_ahead=read_ahead,
                **loader_args,
            )
        if train and "train" in self._resume:
            ordering.load_state_dict(self._resume.pop("train"))
        self.orderings[split] = ordering
        return loader

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def state_dict(self) -> dict:
        """{"train": {epoch, position, world_size, num_batches, seed}}; see the module docstring."""
        ordering = self.orderings.get("train")
        if ordering is None:
            return {}
        state = ordering.state_dict()
        trainer = self.trainer
        if trainer is not None and getattr(trainer, "fit_loop", None) is not None:
            state["position"] = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            if state["position"] >= trainer.num_training_batches:  # e.g. limit_train_batches
                state["position"] = state["num_batches"]  # the epoch is over: resume at the next
        return {"train": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume the data position saved by `state_dict` (applied when the loader is built)."""
        self._resume = dict(state_dict)
        if "train" in self._resume and "train" in self.orderings:
            self.orderings["train"].load_state_dict(self._resume.pop("train"))
        # Lightning warns that a mid-epoch resume is inexact unless the DataLoader object itself
        # is stateful; here the state lives in this DataModule, and the resume is exact.
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
        )

    def teardown(self, stage: str | None = None) -> None:
        for dataset in self.datasets.values():
            if getattr(dataset, "bad_input", None) is not None:
                dataset.bad_input.summarize_epoch("at the end")
