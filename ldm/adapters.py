"""Training modes: how much of a `LatentDiffusion` trains, as one object the module calls.

A mode owns everything that differs between training the whole backbone and training adapters
on a frozen base: what it adds to the model before the weights load (`attach`), what it fixes
after (`after_loading`), the optimizer's parameter groups, what it does to the frozen base at
fit start (`on_fit_start`) and undoes at fit end (`on_fit_end`), how checkpoints are written and
read (`on_save_checkpoint`, `on_load_checkpoint`) and how its weights fold back into the base
(`merge`). `LatentDiffusion`
calls these hooks and never asks which mode it holds, so a new mode (another adapter kind) is a
new class behind this interface, not `if`s in the module.

`FullFineTune` (no `lora:` block) is the no-op mode: every hook leaves the model as it is. LoRA /
LoCon / DoRA is `ldm.lora.mode.LoraMode`, built from `model.params.lora` by `training_mode`.

Encoders say what adapters may target with `lora_targets()` (a list of `AdapterTargets`), so the
adapter code needs no knowledge of their insides (`ldm.text_encoder`, `ldm.conditioning_xl`).
"""

import dataclasses
import importlib
from collections.abc import Mapping

from lightning.pytorch.callbacks import Callback
from torch import nn


@dataclasses.dataclass(frozen=True)
class AdapterTargets:
    """The layers of one text tower that adapters may go on (what its `lora_targets()` says).

    module: the module the adapter library is given (for a transformers model, the library's
        model itself: peft reads its conversion rules from it); the names below are in it.
    layers: Linear layers, in module order.
    parameters: weights adapted as a whole that are not a layer's `weight` (OpenCLIP's fused
        q/k/v `in_proj_weight`: peft's `target_parameters`).
    plain_only: why these layers take plain LoRA only (no dropout, no DoRA), or None.
    tower: the embedder that runs these layers: set trainable, so gradients reach them.
    """

    module: nn.Module
    layers: list[str]
    parameters: list[str] = dataclasses.field(default_factory=list)
    plain_only: str | None = None
    tower: nn.Module | None = None


class TrainingMode:
    """The hooks a training mode implements; this base is full fine-tuning (each one a no-op).

    `settings`: the mode's parsed settings (None here); lun's memory plan and the export script
    read a LoRA run's `lora_settings` through it."""

    settings = None

    def attach(self, model: nn.Module) -> None:
        """Before the weights load (a run's own checkpoint holds what this adds)."""

    def after_loading(self, model: nn.Module, state: Mapping) -> None:
        """After `state` (the loaded file's state dict) went into `model`."""

    def parameter_groups(self, backbone_params: list, text_params: list) -> list:
        """The optimizer's parameters (a list of tensors, or of `{"params", "lr"}` groups) from
        the trainable ones of the backbone and of the conditioner, in that order."""
        return [*backbone_params, *text_params]

    def on_fit_start(self, model: nn.Module, trainer, strategy_casts_parameters: bool) -> None:
        """Once the trainer is known, before the first step (Lightning's `setup("fit")`).
        `strategy_casts_parameters`: the strategy holds the parameters in its own form and dtype
        (FSDP, DeepSpeed; what lun's `lun.strategies.casts_parameters` said)."""

    def on_fit_end(self, model: nn.Module) -> None:
        """When the fit ends - normally, on an exception or on Ctrl-C (`LatentDiffusion.teardown`,
        `FitEnd`) - undo what `on_fit_start` set up that only the fit's device and loop may hold,
        so that the model computes in the same process afterwards (sampling, a second fit).
        Runs before or after the strategy moved the module to the CPU (see `FitEnd`)."""

    def on_save_checkpoint(self, model: nn.Module, ckpt: dict) -> None:
        """Rewrite a Lightning checkpoint as it is saved (its `state_dict`)."""

    def on_load_checkpoint(self, model: nn.Module, ckpt: dict) -> None:
        """The inverse of `on_save_checkpoint`, before Lightning restores the state dict."""

    def merge(self, model: nn.Module, weight: float = 1.0) -> int:
        """Fold the mode's trained weights into the base at `weight`; the number of layers
        changed (none here: the trained weights are the model's own)."""
        return 0


class FitEnd(Callback):
    """The module's `teardown("fit")` on an exception or Ctrl-C too (a LatentDiffusion's own
    callback, `configure_callbacks`). Lightning 2.6's `Trainer._run` calls the LightningModule's
    `teardown` hook only when the fit returns (after `Trainer._teardown`, where the strategy
    moved the module to the CPU); an exception - Ctrl-C included - leaves `fit` through
    `call._call_and_handle_interrupt`, which calls the callbacks' `on_exception` (`_interrupt`)
    and then `Trainer._teardown`, never the module's `teardown`. So the mode's `on_fit_end`
    comes from `teardown` on a normal end and from here otherwise: on all three, once."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if trainer.state.fn == "fit":
            pl_module.teardown("fit")


class FullFineTune(TrainingMode):
    """The whole backbone (and any trainable conditioner) trains; nothing is added or rewritten."""


# The adapter modes by their config key, as dotted names (like a config's `target`): this module
# stays a leaf that the text encoders import for `AdapterTargets`, and ldm.lora, which asks the
# encoders, is imported only when a run asks for it.
ADAPTER_MODES = {"lora": "ldm.lora.mode.from_config"}


def training_mode(lora: Mapping | None) -> TrainingMode:
    """The mode of `model.params.lora` (checked by its mode: a bad value is a ValueError naming
    its key); no block (or `lora: false`) is full fine-tuning."""
    if lora is None or lora is False:
        return FullFineTune()
    module, _, name = ADAPTER_MODES["lora"].rpartition(".")
    return getattr(importlib.import_module(module), name)(lora)
