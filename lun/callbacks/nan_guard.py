"""Skip optimizer steps whose loss or gradients are NaN/inf; stop cleanly when they keep coming."""

import os

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lun.callbacks.measure import batch_size_of


class NonFiniteLossError(RuntimeError):
    """Training stopped after too many consecutive steps with NaN/inf loss or gradients."""


def nonfinite_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    """1.0 when some gradient entry is NaN/inf, else 0.0: a 0-d float tensor on the gradients'
    device, computed there (no host sync).

    On accelerators: one fused inf-norm over all tensors (largest |g|: NaN/inf exactly when some
    entry is, and it cannot overflow), a read-only pass. On the CPU torch's inf-norm is a slow
    per-tensor reduction (~15x the time of the check below for the demo UNet, more than the
    fused AdamW step itself), so there GradScaler's own check is used: it sets the flag when an
    entry is not finite and multiplies by an inverse scale of 1, which leaves every gradient bit
    for bit as it was (`x * 1 == x`, NaN, inf and -0 included)."""
    if grads[0].device.type == "cpu" and not any(g.is_sparse for g in grads):
        found = torch.zeros((), dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(()))
        return found
    largest = torch.stack(torch._foreach_norm(grads, float("inf"))).max()
    return torch.isfinite(largest).logical_not().float()


def skips_on_device(optimizer, trainer) -> bool:
    """Can this optimizer skip a step on a device-side flag? torch's fused optimizers (Adam,
    AdamW, SGD, Adagrad with `fused=True`) read `optimizer.found_inf` - the path GradScaler
    uses - and then leave weights, moments and step count untouched. Under fp16 the GradScaler
    sets that flag itself (from the same gradients), so the host-side path is used there."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and scaler is None


def _drop_found_inf(optimizer, args, kwargs) -> None:
    optimizer.__dict__.pop("found_inf", None)


class NaNGuard(Callback):
    """Skip bad steps, count them, and stop after `max_consecutive` in a row.

    Mechanics: after the backward pass of an optimizer step (`on_before_optimizer_step`, after
    gradient unscaling under fp16) one fused reduction over all gradients says whether any entry
    is NaN/inf. Two ways to skip the step, the same result (weights and optimizer state bitwise
    unchanged; the LR schedule and the step counter still advance):

    - fused optimizers (the default AdamW): the flag stays on the device and is handed to the
      optimizer as `found_inf`, which skips the update inside its kernel. Nothing waits for the
      host: the counters are kept on the device too and read every `check_every` optimizer steps
      (the logging steps). A run of `max_consecutive` bad steps latches a "stopped" flag on the
      device that skips every later step, so when the host reads it the weights are still those
      of the last good step, whatever the delay;
    - other optimizers: the flag is read at once (one host sync per step) and a bad step's
      gradients are dropped (`zero_grad(set_to_none=True)`), so the optimizer leaves the weights
      and its moments alone.

    One bad micro-batch poisons its whole accumulated step, which is skipped as a unit. When the
    gradients are not visible to the optimizer (DeepSpeed keeps its own), the loss decides, after
    the step; the DeepSpeed engine skips overflowing fp16 steps itself. Ranks agree: gradients
    are identical after DDP's all-reduce; sharded ones are reduced with a max.

    The number of skipped steps is logged as `train/skipped_steps`. After `max_consecutive` bad
    steps in a row the weights are still those of the last good step: they are saved to
    `<dirpath>/<filename>` and `NonFiniteLossError` stops the run with a message saying so.

    Args:
        max_consecutive: stop after this many bad optimizer steps in a row (fp16 loss scaling
            alone produces a few at the start; a run that diverged produces them forever).
        dirpath: folder of the last-good checkpoint; None = `<default_root_dir>/checkpoints`.
        filename: its file name.
        check_every: read the device-side counters every this many optimizer steps (fused
            optimizers); None = the trainer's `log_every_n_steps`.
    """

    def __init__(
        self,
        max_consecutive: int = 20,
        dirpath: str | None = None,
        filename: str = "last-good.ckpt",
        check_every: int | None = None,
    ):
        if max_consecutive < 1:
            raise ValueError(f"NaNGuard max_consecutive must be >= 1, got {max_consecutive}")
        if check_every is not None and check_every < 1:
            raise ValueError(f"NaNGuard check_every must be >= 1, got {check_every}")
        self.max_consecutive, self.dirpath, self.filename = max_consecutive, dirpath, filename
        self.check_every = check_every
        self.skipped_steps = 0  # as of the last read
        self.consecutive = 0
        self._bad_grads: bool | None = None  # host verdict of the step in progress (host path)
        self._grads_visible = False  # did the last optimizer step show gradients?
        self._bad_loss = False
        self._step_of_last_batch: int | None = None
        # Device path: [skipped since train start, consecutive, stopped, first bad step of the
        # current run, step at which the run reached max_consecutive] - one tensor, one read.
        self._device_counts: torch.Tensor | None = None
        self._skipped_at_start = 0
        self._hooked: set[int] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        self._step_of_last_batch = trainer.global_step
        self._device_counts = None
        self._skipped_at_start = self.skipped_steps

    # --- the verdict, each optimizer step ---------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        self._grads_visible = bool(grads)
        if not grads:
            return
        bad = nonfinite_flag(grads)
        if skips_on_device(optimizer, trainer):
            self._on_device(trainer, optimizer, bad)
            return
        bad = trainer.strategy.reduce_boolean_decision(bool(bad), all=False)  # a host sync
        if bad:
            optimizer.zero_grad(set_to_none=True)
        self._bad_grads = bad

    def _on_device(self, trainer, optimizer, bad: torch.Tensor) -> None:
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # no host sync
        counts = self._device_counts
        if counts is None or counts.device != bad.device:
            counts = torch.tensor([0.0, self.consecutive, 0.0, -1.0, -1.0], device=bad.device)
            self._device_counts = counts
        if id(optimizer) not in self._hooked:  # the flag is for one step only
            optimizer.register_step_post_hook(_drop_found_inf)
            self._hooked.add(id(optimizer))
        step = float(trainer.global_step + 1)  # the number this optimizer step will have
        skipped, consecutive, stopped, run_start, stop_step = counts.unbind()
        skip = torch.maximum(bad, stopped)  # once stopped, every later step is skipped
        optimizer.found_inf = skip
        run_start.copy_(torch.where((bad > 0) & (consecutive == 0), step, run_start))
        consecutive.add_(1.0).mul_(bad)
        skipped.add_(skip)
        reached = (consecutive >= self.max_consecutive) & (stopped == 0)
        stop_step.copy_(torch.where(reached, step, stop_step))
        stopped.copy_(torch.maximum(stopped, reached.float()))

    # --- counting, logging, stopping --------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not self._grads_visible and isinstance(loss, torch.Tensor):  # a host sync; only then
            self._bad_loss = self._bad_loss or not bool(torch.isfinite(loss).all())
        step = trainer.global_step
        if step == self._step_of_last_batch:
            return  # inside gradient accumulation
        self._step_of_last_batch = step
        if self._device_counts is not None and self._bad_grads is None and self._grads_visible:
            every = self.check_every or max(trainer.log_every_n_steps, 1)
            if step % every == 0:
                self._read_device_counts(trainer, step)
                self._log(pl_module, batch)
            return
        if self._bad_grads is None:
            bad = trainer.strategy.reduce_boolean_decision(self._bad_loss, all=False)
        else:
            bad = self._bad_grads
        self._bad_grads, self._bad_loss = None, False
        if bad:
            self.skipped_steps += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        self._log(pl_module, batch)
        if bad and self.consecutive < self.max_consecutive:
            rank_zero_warn(
                f"step {step}: NaN/inf loss or gradients, step skipped "
                f"({self.consecutive} in a row, {self.skipped_steps} in total)"
            )
        if self.consecutive >= self.max_consecutive:
            self._stop(trainer, step - self.consecutive + 1, step)

    def _log(self, pl_module, batch) -> None:
        pl_module.log(
            "train/skipped_steps",
            float(self.skipped_steps),
            on_step=True,
            on_epoch=False,
            batch_size=batch_size_of(batch),
        )

    def _read_device_counts(self, trainer, step: int, stop: bool = True) -> None:
        """Bring the device-side counters to the host (the one sync), warn, maybe stop."""
        if self._device_counts is None:
            return
        skipped, consecutive, stopped, run_start, stop_step = self._device_counts.tolist()
        before = self.skipped_steps
        self.skipped_steps = self._skipped_at_start + int(skipped)
        self.consecutive = int(consecutive)
        if stopped:
            if stop:
                self.consecutive = self.max_consecutive
                self._stop(trainer, int(run_start), int(stop_step), now=step)
            return
        if self.skipped_steps > before:
            rank_zero_warn(
                f"step {step}: {self.skipped_steps - before} optimizer step(s) with NaN/inf "
                f"gradients skipped since the last check ({self.consecutive} in a row now, "
                f"{self.skipped_steps} in total)"
            )

    def on_train_end(self, trainer, pl_module) -> None:
        self._read_device_counts(trainer, trainer.global_step)

    def _stop(self, trainer, first: int, last: int, now: int | None = None) -> None:
        folder = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(folder, self.filename)
        trainer.save_checkpoint(path)
        later = (
            f" (seen at step {now}; every step after {last} was skipped too)"
            if now is not None and now != last
            else ""
        )
        raise NonFiniteLossError(
            f"the loss or gradients were NaN/inf for {last - first + 1} optimizer steps in a row "
            f"(steps {first}-{last}){later}; training stopped. Those steps were skipped, so the "
            f"weights are those of step {first - 1}, saved in {path} (resume from it). Usual "
            "causes: a learning rate too high, fp16 overflow (try bf16), or corrupt images in "
            "the data."
        )

    def state_dict(self) -> dict:
        if self._device_counts is not None:  # a checkpoint is a sync point anyway
            skipped, consecutive, stopped = self._device_counts[:3].tolist()
            self.skipped_steps = self._skipped_at_start + int(skipped)
            self.consecutive = self.max_consecutive if stopped else int(consecutive)
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.consecutive = state_dict["consecutive"]
