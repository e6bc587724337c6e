"""The frozen base while a LoRA run trains: held in the training dtype (`base_dtype`), its blocks
quantized (`base_quantization`, `ldm.quantize`) and / or swapped to host RAM (`blocks_to_swap`)."""

import torch
from torch import nn

from ldm.lora.settings import BASE_DTYPES, fail
from ldm.lora.targets import lora_able


def hold_base_for_training(
    model: nn.Module, trainer, strategy_casts_parameters: bool = False
) -> None:
    """At fit start: the frozen weights of the backbone in the training dtype (`base_dtype`).
    `strategy_casts_parameters` (FSDP, DeepSpeed: they flatten / cast the parameters
    themselves): with `base_dtype: auto` the base is left to the strategy."""
    settings = model.lora_settings
    if settings.base_dtype == "auto" and strategy_casts_parameters:
        return
    dtype = training_dtype(trainer.precision, settings.base_dtype)
    quantize_base(model, settings.base_quantization, dtype or torch.float32, trainer)
    if dtype is not None and dtype != torch.float32:
        hold_frozen_in(model.model, dtype)
    if settings.swapped_blocks:  # "auto" is resolved by lun's memory plan; unresolved: none
        from ldm.block_swap import swap_blocks

        swap_blocks(model.model, settings.swapped_blocks, trainer.strategy.root_device)


def release_base_after_training(model: nn.Module) -> None:
    """At fit end: block swap undone (`ldm.block_swap.unswap_blocks`), the swapped blocks'
    weights back in the model as its own host tensors. The dtype and the quantization stay:
    they are the model's form, not the fit's (a second fit finds them done)."""
    from ldm.block_swap import unswap_blocks

    unswap_blocks(model.model)


def quantize_base(model: nn.Module, kind: str, compute_dtype: torch.dtype, trainer=None) -> int:
    """The frozen backbone quantized as `base_quantization` says (once: `lun.memory_quant`
    may have done it before the plan; "auto" is resolved there, else it means none). On the
    run's device, layer by layer, though this runs in Lightning's setup, before the model
    moves there: the quantized layers stay on the CPU, as the rest of the model."""
    from ldm import quantize

    if kind in ("none", "auto") or quantize.is_quantized(model.model):
        return 0
    device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
    why = quantize.unsupported(kind, device)
    if why:
        fail("base_quantization", why)
    return quantize_blocks(model.model, kind, compute_dtype, device)


def quantize_blocks(
    backbone: nn.Module, kind: str, compute_dtype: torch.dtype, device: torch.device | None = None
) -> int:
    """The frozen layers of the backbone's blocks quantized (nearly all of its weights); the
    embedders and the output layer, small and read for their dtype, stay as they are (as
    musubi-tuner and ai-toolkit keep them). Quantized on `device` (the run's), one layer at a
    time, each kept where it was (`ldm.quantize.quantize_frozen`)."""
    from ldm import quantize
    from ldm.block_swap import blocks_of

    blocks = blocks_of(backbone)
    return sum(quantize.quantize_frozen(b, kind, compute_dtype, device) for b in blocks)


def training_dtype(precision: str, base_dtype: str = "auto") -> torch.dtype | None:
    """The frozen weights' dtype for a trainer precision ("bf16-mixed" -> bf16), or None."""
    if base_dtype != "auto":
        return BASE_DTYPES[base_dtype]
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def _input_to_weight_dtype(module, args):
    module.input_dtype = args[0].dtype  # for the way out (the forward hook sees the cast input)
    return (args[0].to(module.weight.dtype), *args[1:])


def _output_to_input_dtype(module, args, output):
    # Under autocast the next op casts as it likes; without it (e.g. sampling outside the
    # training step) the activations keep their dtype, so fp32 layers after this one work.
    if torch.is_autocast_enabled(output.device.type):
        return output
    return output.to(module.input_dtype)


def hold_frozen_in(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast the frozen Linear / Conv2d layers of `module` to `dtype` (halves the base's memory
    under bf16/fp16 training); their inputs are cast on the way in and back on the way out.
    Norms stay float32 (small, and precision-sensitive). Returns the number of layers cast."""
    from ldm.quantize import is_quantized

    count = 0
    for layer in module.modules():
        if not lora_able(layer) or any(p.requires_grad for p in layer.parameters()):
            continue
        if is_quantized(layer):  # bitsandbytes' Linear8bitLt is an nn.Linear: its own dtypes
            continue
        if layer.weight.dtype == dtype:
            continue
        layer.to(dtype)
        layer.register_forward_pre_hook(_input_to_weight_dtype)
        layer.register_forward_hook(_output_to_input_dtype, with_kwargs=False)
        count += 1
    return count
