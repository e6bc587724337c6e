"""Adapters folded into the base weights: the model's own (`merge_adapters`) or a file's, ours
or any trainer's (`merge_file`), through peft's layers."""

from collections.abc import Mapping

import torch
from torch import nn

from ldm.layout import kohya as lora_kohya
from ldm.layout import original
from ldm.layout.family import is_sdxl  # kohya names SDXL's layers its own way
from ldm.lora.files import _magnitude_of
from ldm.lora.inject import inject
from ldm.lora.targets import (
    ADAPTER,
    Family,
    adapter_layers,
    backbone_family,
    has_adapters,
    is_lora_layer,
    lora_able,
    res_blocks_of,
)


def _unload(model: nn.Module) -> None:
    """Replace every peft layer by its base layer (after merging, or to drop the adapters)."""
    for name, layer in reversed(list(model.named_modules())):  # inner layers first
        if is_lora_layer(layer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    for module in model.modules():  # peft's record of the adapters it added, now gone
        if hasattr(module, "peft_config"):
            del module.peft_config


@torch.no_grad()
def merge_adapters(model: nn.Module, weight: float = 1.0, adapter: str = ADAPTER) -> int:
    """Fold `adapter` into the base weights and remove every peft layer; returns the number of
    layers merged. The model is then a plain original one. At `weight` w the merged weight is
    W + w (W1 - W), W1 being peft's merge at full strength: for LoRA that is W + w s B A, and
    for DoRA it is how kohya-format loaders apply a strength (ComfyUI's weight_decompose)."""
    layers = adapter_layers(model, adapter)
    for layer in layers.values():
        # the wrapped weight: a layer's `weight`, or a wrapped parameter (OpenCLIP's in_proj)
        base = getattr(layer.get_base_layer(), getattr(layer, "parameter_name", "weight"))
        before = base.detach().clone() if weight != 1.0 else None
        layer.merge(safe_merge=True, adapter_names=[adapter])
        if before is not None:
            base.data = torch.lerp(before, base.detach(), weight)
    _unload(model)
    return len(layers)


def kohya_modules(model: nn.Module) -> dict[str, str]:
    """kohya LoRA name -> module name in `model` (a LatentDiffusion without adapters), for every
    UNet and CLIP text-encoder Linear / Conv2d that has a kohya name (each of its names)."""
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    found = {}
    for name, module in model.named_modules():
        if lora_able(module):
            try:
                found.update(dict.fromkeys(lora_kohya.kohya_names(name, res_blocks, sdxl), name))
            except ValueError:
                continue
    return found


@torch.no_grad()
def merge_kohya(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    weight: float = 1.0,
    source: str = "LoRA file",
    magnitudes: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Merge a kohya LoRA state dict (ours or any trainer's) into `model`'s base weights at
    `weight`, through peft's layers; returns the number of layers changed. Adapters already in
    the model must be merged first (`merge_adapters`). `magnitudes`: DoRA magnitudes by kohya
    name in peft's own form (diffusers-format files), instead of kohya's `dora_scale`."""
    magnitudes = magnitudes or {}
    if has_adapters(model):
        raise ValueError("merge the model's own adapters first (merge_adapters)")
    family = backbone_family(model.backbone)
    if family is not None:
        return _merge_family(model, family, state, weight)
    modules = kohya_modules(model)
    downs = sorted(
        k.removesuffix(".lora_down.weight") for k in state if k.endswith(".lora_down.weight")
    )
    if not downs:
        raise ValueError(f"{source}: no kohya LoRA weights (<name>.lora_down.weight) in it")
    fused = _merge_split_qkv(model, state, downs, weight, source)
    downs = [k for k in downs if k not in fused]
    if not downs:
        return len(fused)
    unknown = [k for k in downs if k not in modules]
    if unknown:
        raise ValueError(
            f"{source}: {len(unknown)} LoRA modules do not exist in this model, e.g. {unknown[0]} "
            "(a LoRA for another model family?)"
        )
    names = [modules[k] for k in downs]
    ranks = {modules[k]: state[k + ".lora_down.weight"].shape[0] for k in downs}
    alphas = {
        modules[k]: float(state[k + ".alpha"])
        if k + ".alpha" in state
        else float(ranks[modules[k]])
        for k in downs
    }
    dora = any(k + ".dora_scale" in state or k in magnitudes for k in downs)
    adapter = "merge"
    inject(model, names, ranks, alphas, use_dora=dora, init_lora_weights=False, adapter=adapter)
    for kohya, name in zip(downs, names):
        layer = model.get_submodule(name)
        layer.lora_A[adapter].weight.copy_(state[kohya + ".lora_down.weight"])
        layer.lora_B[adapter].weight.copy_(state[kohya + ".lora_up.weight"])
        if dora:
            magnitude = layer.lora_magnitude_vector[adapter].weight
            found = magnitudes.get(kohya)
            if found is None:
                found = _magnitude_of(layer, adapter, state[kohya + ".dora_scale"], source)
            magnitude.copy_(found.reshape(magnitude.shape))
    return merge_adapters(model, weight, adapter) + len(fused)


def _merge_family(model: nn.Module, family: Family, state, weight: float) -> int:
    """`merge_kohya` for a backbone that owns its LoRA rules (SD3, Flux): its layout reads the
    file into {module: (down, up, alpha)}, merged through peft's layers as for the UNet."""
    linears = [n for n, m in model.backbone.named_modules() if isinstance(m, nn.Linear)]
    adapters = family.layout.from_kohya(state, linears)
    names = {original.unet_key(m): v for m, v in adapters.items()}
    ranks = {n: down.shape[0] for n, (down, _, _) in names.items()}
    alphas = {n: alpha for n, (_, _, alpha) in names.items()}
    adapter = "merge"
    inject(model, list(names), ranks, alphas, init_lora_weights=False, adapter=adapter)
    for name, (down, up, _) in names.items():
        layer = model.get_submodule(name)
        layer.lora_A[adapter].weight.copy_(down)
        layer.lora_B[adapter].weight.copy_(up)
    return merge_adapters(model, weight, adapter)


def _merge_split_qkv(model, state, downs: list[str], weight: float, source: str) -> set[str]:
    """The q/k/v LoRAs of an OpenCLIP text encoder (SD 2.x; kohya / diffusers name its split
    q_proj/k_proj/v_proj) added to their rows of the fused `in_proj_weight` by kohya's rule,
    W += weight * alpha / rank * up @ down (no peft layer holds a third of a weight); returns
    the kohya names merged."""
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    rows = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "in_proj_weight", None), nn.Parameter):
            for index, part in enumerate("qkv"):
                try:
                    rows[lora_kohya.kohya_name(f"{name}.in_proj.{part}", res_blocks, sdxl)] = (
                        module,
                        index,
                    )
                except ValueError:
                    continue
    merged = {k for k in downs if k in rows}
    for kohya in merged:
        if kohya + ".dora_scale" in state:
            raise ValueError(f"{source}: {kohya}: DoRA on the split q/k/v is not supported")
        down, up = state[kohya + ".lora_down.weight"], state[kohya + ".lora_up.weight"]
        alpha = float(state[kohya + ".alpha"]) if kohya + ".alpha" in state else down.shape[0]
        module, index = rows[kohya]
        fused = module.in_proj_weight
        width = fused.shape[0] // 3
        delta = (up.float() @ down.float()) * (weight * alpha / down.shape[0])
        fused.data[index * width : (index + 1) * width] += delta.to(fused)
    return merged


def merge_file(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    weight: float = 1.0,
    source: str = "LoRA file",
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Merge a LoRA file's state dict, kohya or diffusers format (its safetensors `metadata`
    may hold diffusers' alphas), into `model` at `weight` (`merge_kohya`)."""
    family = backbone_family(model.backbone)
    if family is not None and not any(k.endswith(".lora_down.weight") for k in state):
        # diffusers' names (transformer.*.lora_A/B, split q/k/v) -> the kohya file of the same update
        state = family.layout.kohya_from_diffusers(state, metadata)
    if lora_kohya.is_diffusers_format(state):
        state, magnitudes = lora_kohya.from_diffusers(state, metadata, is_sdxl(model))
        return merge_kohya(model, state, weight, source, magnitudes)
    return merge_kohya(model, state, weight, source)
