"""LoRA / LoCon / DoRA as a training mode (`ldm.adapters.TrainingMode`): the hooks
`LatentDiffusion` calls, each one a step of `ldm.lora`."""

from collections.abc import Mapping

from torch import nn

from ldm.adapters import TrainingMode
from ldm.lora.base import hold_base_for_training, release_base_after_training
from ldm.lora.checkpoints import load_layout, save_layout
from ldm.lora.inject import add_adapters, after_loading
from ldm.lora.merge import merge_adapters
from ldm.lora.settings import LoraSettings, parse_settings


class LoraMode(TrainingMode):
    """Adapters on a frozen base, as `settings` (`model.params.lora`) say."""

    def __init__(self, settings: LoraSettings):
        self.settings = settings

    def attach(self, model: nn.Module) -> None:
        if self.settings.swapped_blocks:  # a count beyond the blocks: one line before any run
            from ldm.block_swap import check_swap_count

            check_swap_count(model.model, self.settings.swapped_blocks)
        add_adapters(model, self.settings)  # before loading: a LoRA run's file has them

    def after_loading(self, model: nn.Module, state: Mapping) -> None:
        after_loading(model, state)

    def parameter_groups(self, backbone_params: list, text_params: list) -> list:
        """The text encoder's adapters at their own rate when `text_encoder.lr` is set (kohya's
        `--text_encoder_lr`)."""
        text = self.settings.text_encoder
        if text is None or not text.lr or not text_params:
            return super().parameter_groups(backbone_params, text_params)
        return [{"params": backbone_params}, {"params": text_params, "lr": text.lr}]

    def on_fit_start(self, model: nn.Module, trainer, strategy_casts_parameters: bool) -> None:
        hold_base_for_training(model, trainer, strategy_casts_parameters)

    def on_fit_end(self, model: nn.Module) -> None:
        release_base_after_training(model)

    def on_save_checkpoint(self, model: nn.Module, ckpt: dict) -> None:
        save_layout(model, ckpt)

    def on_load_checkpoint(self, model: nn.Module, ckpt: dict) -> None:
        load_layout(model, ckpt)

    def merge(self, model: nn.Module, weight: float = 1.0) -> int:
        return merge_adapters(model, weight)


def from_config(lora: Mapping) -> LoraMode:
    """`model.params.lora` -> the mode (`ldm.adapters.training_mode` asks it by name)."""
    return LoraMode(parse_settings(lora))
