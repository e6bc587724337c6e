"""Lightning's ModelCheckpoint with a samples-seen trigger, self-explaining names and a final save.

The default set (`lun.callbacks.defaults`) uses this class three times: a frequent checkpoint that
overwrites itself (`every-2k-steps.ckpt`) with `last.ckpt` linked to it, periodic ones that are
kept (`step-000010000.ckpt`), and the best by a validation metric (`best.ckpt`). Every write goes
through the trainer's CheckpointIO, i.e. `lun.atomic_io.AtomicCheckpointIO` in our launcher.
"""

import os
import re

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lun.atomic_io import atomic_link
from lun.callbacks.measure import batch_size_of


def _short(n: int) -> str:
    """2000 -> "2k", 1500 -> "1500", 3000000 -> "3M": how people say step counts."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


class Checkpoint(ModelCheckpoint):
    """`ModelCheckpoint` (all its arguments) plus:

    - `save_every_n_samples`: save each time this many more images have been seen across all
      devices (an alternative to `every_n_train_steps` that does not change meaning when the
      batch size or device count does). Saves happen on optimizer-step boundaries, and
      `{samples}` may be used in `filename`.
    - names that say what a file holds when `filename` is not given: `every-2k-steps` /
      `every-1M-samples` for a checkpoint that overwrites itself (`save_top_k: 1`, no monitor),
      `best` for the best by `monitor`, `step-{step:09d}` for checkpoints that are kept.
    - `save_on_train_end`: also save when training ends (and update `last.ckpt`), so the final
      weights are never up to `every_n_train_steps` steps old.
    - `save_last: link` swaps `last.ckpt` atomically (a new link renamed over the old one).

    Defaults that differ from ModelCheckpoint's: `auto_insert_metric_name=False` (the names above
    already spell out their fields) and `enable_version_counter=False` (a fixed name overwrites
    itself - atomically - instead of piling up `-v1`, `-v2` copies).

    Args:
        save_every_n_samples: images seen (all devices) between saves; exclusive with the
            `every_n_*` and `train_time_interval` triggers.
        save_on_train_end: save when `fit` ends normally.
        **kwargs: `lightning.pytorch.callbacks.ModelCheckpoint` arguments (`dirpath`, `filename`,
            `monitor`, `mode`, `save_top_k`, `save_last` ("link" makes `last.ckpt` a link to the
            newest file instead of a second write), `every_n_train_steps`, `save_weights_only`
            (note: weights-only files carry no EMA), `save_on_exception`, ...).
    """

    def __init__(
        self,
        save_every_n_samples: int | None = None,
        save_on_train_end: bool = False,
        auto_insert_metric_name: bool = False,
        enable_version_counter: bool = False,
        **kwargs,
    ):
        if save_every_n_samples is not None:
            if save_every_n_samples < 1:
                raise ValueError(f"save_every_n_samples must be >= 1, got {save_every_n_samples}")
            others = [
                k
                for k in ("every_n_train_steps", "every_n_epochs", "train_time_interval")
                if kwargs.get(k)
            ]
            if others:  # (an override of the default's cadence replaces it: lun.trainer)
                raise ValueError(
                    f"save_every_n_samples cannot be combined with {', '.join(others)}: "
                    "give one save cadence"
                )
            kwargs["every_n_epochs"] = 0  # ModelCheckpoint would otherwise default to every epoch
        if kwargs.get("filename") is None:
            kwargs["filename"] = self._default_filename(save_every_n_samples, **kwargs)
        super().__init__(
            auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=enable_version_counter,
            **kwargs,
        )
        self.save_every_n_samples = save_every_n_samples
        self.save_on_train_end = save_on_train_end
        self.samples_seen = 0
        self._samples_in_step = 0  # this rank's samples since the last optimizer step
        self._step_of_last_batch: int | None = None

    @staticmethod
    def _default_filename(
        save_every_n_samples,
        monitor=None,
        save_top_k=1,
        every_n_train_steps=None,
        every_n_epochs=None,
        **_,
    ) -> str:
        if monitor is not None:
            if save_top_k == 1:
                return "best"
            metric = re.sub(r"[^A-Za-z0-9]+", "_", monitor)  # val/loss -> val_loss
            return f"best-{metric}-step-" + "{step:09d}"
        if save_top_k == 1:
            if save_every_n_samples:
                return f"every-{_short(save_every_n_samples)}-samples"
            if every_n_train_steps:
                return f"every-{_short(every_n_train_steps)}-steps"
            if every_n_epochs:
                return f"every-{_short(every_n_epochs)}-epochs"
            return "latest"
        return "samples-{samples:012d}" if save_every_n_samples else "step-{step:09d}"

    # The config's name for this callback (`lightning.callbacks.<name>`), set by the launcher
    # only where two checkpoints' settings below are the same (they differ by `dirpath`,
    # `save_top_k`, ...): it then joins the state key, which stays the same from run to run.
    config_name: str | None = None

    @property
    def state_key(self) -> str:
        # Several instances differ only by these; each must find its own state on resume.
        settings = dict(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
            save_every_n_samples=self.save_every_n_samples,
            filename=self.filename,
        )
        if self.config_name is not None:
            settings["name"] = self.config_name
        return self._generate_state_key(**settings)

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        # Lightning removes `last.ckpt` and then links it: a death in between leaves no
        # `last.ckpt`. Here the new link replaces the old one in a single rename.
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            atomic_link(filepath, linkpath)
        trainer.strategy.barrier()

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        candidates = super()._monitor_candidates(trainer)
        candidates["samples"] = torch.tensor(self.samples_seen)
        return candidates

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.save_every_n_samples:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        self._samples_in_step += batch_size_of(batch)
        step = trainer.global_step
        stepped = self._step_of_last_batch is not None and step != self._step_of_last_batch
        self._step_of_last_batch = step
        if not stepped:
            return  # only at optimizer-step boundaries: a mid-accumulation save cannot resume exactly
        # Exact images across devices (ranks may see different batch sizes), and one number on
        # every rank, so all ranks take the same save decision.
        local = torch.tensor(self._samples_in_step, device=pl_module.device)
        seen = int(trainer.strategy.reduce(local, reduce_op="sum"))
        self._samples_in_step = 0
        before, self.samples_seen = self.samples_seen, self.samples_seen + seen
        if self.samples_seen // self.save_every_n_samples == before // self.save_every_n_samples:
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_of_last_batch = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        if (
            self.save_on_train_end
            and self.monitor is None
            and not self._should_skip_saving_checkpoint(trainer)
        ):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.samples_seen = state_dict.get("samples_seen", 0)
