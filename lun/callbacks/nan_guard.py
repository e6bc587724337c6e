"""Skip optimizer steps whose loss or gradients are NaN/inf; stop cleanly when they keep coming."""

import os

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lun.callbacks.progress import batch_size_of


class NonFiniteLossError(RuntimeError):
    """Training stopped after too many consecutive steps with NaN/inf loss or gradients."""


class NaNGuard(Callback):
    """Skip bad steps, count them, and stop after `max_consecutive` in a row.

    Mechanics: after the backward pass of an optimizer step (`on_before_optimizer_step`, after
    gradient unscaling under fp16) the largest absolute gradient is checked; if it is not finite
    the gradients are dropped (`zero_grad(set_to_none=True)`), so the optimizer leaves the weights
    and its moments alone - the step is skipped. (The LR schedule and the step counter still
    advance.) One bad micro-batch poisons its whole accumulated step, which is skipped as a unit.
    When the gradients are not visible to the optimizer (DeepSpeed keeps its own), the loss
    decides, after the step; the DeepSpeed engine skips overflowing fp16 steps itself.

    The decision is reduced over ranks ("any rank saw a bad value"), so all ranks skip together.
    The number of skipped steps is logged as `train/skipped_steps`. After `max_consecutive` bad
    steps in a row the weights are still those of the last good step: they are saved to
    `<dirpath>/<filename>` and `NonFiniteLossError` stops the run with a message saying so.

    Args:
        max_consecutive: stop after this many bad optimizer steps in a row (fp16 loss scaling
            alone produces a few at the start; a run that diverged produces them forever).
        dirpath: folder of the last-good checkpoint; None = `<default_root_dir>/checkpoints`.
        filename: its file name.
    """

    def __init__(
        self,
        max_consecutive: int = 20,
        dirpath: str | None = None,
        filename: str = "last-good.ckpt",
    ):
        if max_consecutive < 1:
            raise ValueError(f"NaNGuard max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive, self.dirpath, self.filename = max_consecutive, dirpath, filename
        self.skipped_steps = 0
        self.consecutive = 0
        self._bad_grads: bool | None = (
            None  # verdict of the step in progress; None = no gradients seen
        )
        self._grads_visible = False  # did the last optimizer step show gradients?
        self._bad_loss = False
        self._step_of_last_batch: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._step_of_last_batch = trainer.global_step

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
        # The inf-norm (largest |g|) is NaN/inf exactly when some entry is, and cannot overflow.
        largest = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))
        bad = trainer.strategy.reduce_boolean_decision(not bool(torch.isfinite(largest)), all=False)
        if bad:
            optimizer.zero_grad(set_to_none=True)
        self._bad_grads = bad

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not self._grads_visible and isinstance(
            loss, torch.Tensor
        ):  # a host sync; only when needed
            self._bad_loss = self._bad_loss or not bool(torch.isfinite(loss).all())
        step = trainer.global_step
        if step == self._step_of_last_batch:
            return  # inside gradient accumulation
        self._step_of_last_batch = step
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
        pl_module.log(
            "train/skipped_steps",
            float(self.skipped_steps),
            on_step=True,
            on_epoch=False,
            batch_size=batch_size_of(batch),
        )
        if bad and self.consecutive < self.max_consecutive:
            rank_zero_warn(
                f"step {step}: NaN/inf loss or gradients, step skipped "
                f"({self.consecutive} in a row, {self.skipped_steps} in total)"
            )
        if self.consecutive >= self.max_consecutive:
            self._stop(trainer, step)

    def _stop(self, trainer, step: int) -> None:
        folder = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(folder, self.filename)
        trainer.save_checkpoint(path)
        first = step - self.consecutive + 1
        raise NonFiniteLossError(
            f"the loss or gradients were NaN/inf for {self.consecutive} optimizer steps in a row "
            f"(steps {first}-{step}); training stopped. Those steps were skipped, so the weights are "
            f"those of step {first - 1}, saved in {path} (resume from it). Usual causes: a learning "
            "rate too high, fp16 overflow (try bf16), or corrupt images in the data."
        )

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.consecutive = state_dict["consecutive"]
