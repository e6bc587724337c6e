"""Gradient clipping by norm under FSDP, which Lightning's FSDP precision plugin refuses.

With sharded gradients each rank holds a part of every gradient, so the norm of the whole
gradient needs the squared norms of all shards summed across ranks: `torch.nn.utils.
clip_grad_norm_` on one rank's shards (what Lightning's plugin would call) clips by the wrong
norm. torch's FSDP does it right in `FullyShardedDataParallel.clip_grad_norm_` on the root unit
(torch docs, "Gradient Clipping"), but Lightning's plugin has no reference to that root, so it
raises "gradient_clip_algorithm='norm' is currently not supported for FSDPPrecision".

`lun.trainer.build_trainer` therefore hands `lightning.trainer.gradient_clip_val` of an FSDP run
to this callback instead of the Trainer: after the backward (and the loss scaler's unscale,
under 16-mixed) and before the optimizer step, on every rank, it clips with the root's own
`clip_grad_norm_`. Same result as `gradient_clip_val` under DDP.
"""

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.callbacks import Callback

from lun.errors import ConfigError

KEY = "lightning.trainer.gradient_clip_val"


def fsdp_clipping(kwargs: dict):
    """For Trainer `kwargs` whose strategy is FSDP and which clip by norm (the default
    algorithm): take `gradient_clip_val` out of them and return the callback that clips
    instead; otherwise None (kwargs unchanged)."""
    from lun.strategies import strategy_kind

    value = kwargs.get("gradient_clip_val")
    algorithm = kwargs.get("gradient_clip_algorithm") or "norm"
    if not value or algorithm != "norm" or strategy_kind(kwargs.get("strategy")) != "fsdp":
        return None
    kwargs.pop("gradient_clip_val")
    kwargs.pop("gradient_clip_algorithm", None)
    return FSDPGradientClipping(float(value))


class FSDPGradientClipping(Callback):
    """Clip the gradient's total norm (all ranks' shards) to `max_norm` before each optimizer
    step, with FSDP's own `clip_grad_norm_` on the root unit."""

    def __init__(self, max_norm: float):
        if not max_norm > 0:
            raise ConfigError(f"{KEY}={max_norm!r}: expected a number > 0 (or null: no clipping)")
        self.max_norm = max_norm

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization:
            raise ValueError(
                f"{KEY}: {type(pl_module).__name__} steps its own optimizers (manual "
                "optimization), which Lightning does not clip; remove gradient_clip_val"
            )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        roots = FullyShardedDataParallel.fsdp_modules(trainer.strategy.model, root_only=True)
        if len(roots) != 1:
            raise RuntimeError(f"{KEY}: expected one FSDP root unit, found {len(roots)}")
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and _optimizer_handles_unscaling(optimizer):
            # Lightning leaves the unscale to such an optimizer's step: unscale here, to clip
            # true gradients (the scaler then steps it without unscaling again).
            scaler.unscale_(optimizer)
        with torch.no_grad():
            roots[0].clip_grad_norm_(self.max_norm)
