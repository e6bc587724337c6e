"""A LoRA run's checkpoints: written in the original layout with the adapters apart
(`ldm.layout.peft`), whatever the base's quantization, and read back into the module's names."""

import torch
from torch import nn

from ldm.layout import peft, wrappers


def _backbone_names(model: nn.Module) -> list[str]:
    return [wrappers.without_wrapper_levels(n) for n, _ in model.model.named_parameters()]


def save_layout(model: nn.Module, ckpt: dict) -> None:
    """A Lightning checkpoint's state dict (and the EMA's shadows in it) in the original layout
    with the adapters apart (`ldm.layout.peft.to_original_layout`). Sharded state dicts (FSDP's
    sharded checkpoints) keep the module's names: their loader reads them by those names."""
    state = ckpt.get("state_dict")
    if state and all(type(v) in (torch.Tensor, nn.Parameter) for v in state.values()):
        _dequantized(model, state)
        ckpt["state_dict"] = peft.to_original_layout(state, _backbone_names(model))


def _quantized_entries(model: nn.Module, state: dict) -> dict[str, list[str]]:
    """Quantized layer name -> its keys in `state` (the module's names)."""
    from ldm import quantize

    layers = quantize.quantized_layers(model)
    return {n: [k for k in state if k.startswith(n + ".")] for n in layers}


def _dequantized(model: nn.Module, state: dict) -> None:
    """A quantized base's layers in `state` as plain `weight` (and `bias`) in host RAM, one
    layer at a time: checkpoints are the same whatever the base's quantization."""
    from ldm import quantize

    for name, keys in _quantized_entries(model, state).items():
        layer = model.get_submodule(name)
        for key in keys:
            del state[key]
        state[f"{name}.weight"] = quantize.dequantize(layer).cpu()
        if getattr(layer, "bias", None) is not None:
            state[f"{name}.bias"] = quantize.stored(layer, "bias").detach().cpu()


def _requantized(model: nn.Module, state: dict) -> None:
    """Resuming onto a quantized base (quantized at fit start, before the restore): its frozen
    layers keep the model's own quantized tensors - the same base file, quantized the same way
    - in place of the checkpoint's plain copies."""
    own = model.state_dict()
    for name, keys in _quantized_entries(model, own).items():
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
        state.update({k: own[k] for k in keys})


def load_layout(model: nn.Module, ckpt: dict) -> None:
    """The inverse of `save_layout`, before Lightning and the callbacks read the state dict."""
    state = ckpt.get("state_dict")
    if state:
        keys = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
        keys = [wrappers.without_wrapper_levels(k) for k in keys]
        peft.to_module_layout(state, keys, _backbone_names(model))
        _requantized(model, state)
