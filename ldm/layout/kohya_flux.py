"""Flux.1 LoRA files: kohya-ss's format (sd-scripts `networks/lora_flux.py`, read by ComfyUI,
Forge, diffusers) and diffusers' / peft's format, from our adapters on ldm.flux.Flux.

An adapter here is (down, up, alpha) on one Linear of the backbone, named as BFL names the module
(`double_blocks.0.img_attn.qkv`); the layer's update is up @ down * alpha / rank (peft's scaling).

kohya: the module name with `.` -> `_` under `lora_unet_`:
    `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` (rank, in), `.lora_up.weight`
    (out, rank), `.alpha` (0-dim). The fused q/k/v and `linear1` stay fused, as BFL's weights.
diffusers: `transformer.<FluxTransformer2DModel module>.lora_A.weight` / `.lora_B.weight`, alpha
    / rank folded into lora_B (no alpha in the file: diffusers then scales by 1). diffusers splits
    BFL's fused layers, so a fused adapter becomes one adapter per part sharing lora_A, lora_B cut
    row-wise: `img_attn.qkv` -> `attn.to_q | to_k | to_v`, `txt_attn.qkv` -> `attn.add_q_proj |
    add_k_proj | add_v_proj`, `single_blocks.N.linear1` -> `attn.to_q | to_k | to_v | proj_mlp`
    (the q, k, v rows first, then the MLP's; diffusers' single-file converter splits the same way).
"""

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

KOHYA_PREFIX = "lora_unet_"
DIFFUSERS_PREFIX = "transformer."
# a LatentDiffusion's backbone (ldm.layout.flux), and the same seen from its `model` wrapper
BACKBONE_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# BFL module (after `double_blocks.N.` / `single_blocks.N.`) -> diffusers module(s) under
# `transformer_blocks.N.` / `single_transformer_blocks.N.`; several = the fused rows in order.
DOUBLE_BLOCK = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "txt_mod.lin": ("norm1_context.linear",),
}
SINGLE_BLOCK = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")


def bare(module: str) -> str:
    """A module name without a LatentDiffusion's backbone prefix."""
    for prefix in BACKBONE_PREFIXES:
        if module.startswith(prefix):
            return module.removeprefix(prefix)
    return module


def kohya_name(module: str) -> str:
    """`double_blocks.0.img_attn.qkv` -> `lora_unet_double_blocks_0_img_attn_qkv`."""
    return KOHYA_PREFIX + bare(module).replace(".", "_")


def kohya_modules(modules: Iterable[str]) -> dict[str, str]:
    """kohya name -> module name, for `modules` (a kohya name loses the dots, so it is read back
    by looking it up among the model's own modules)."""
    return {kohya_name(m): bare(m) for m in modules}


def diffusers_modules(module: str) -> tuple[str, ...]:
    """A BFL block module -> its diffusers module(s), fused rows in order."""
    match = _BLOCK.match(bare(module))
    rules = {"double_blocks": DOUBLE_BLOCK, "single_blocks": SINGLE_BLOCK}
    if not match or match[3] not in rules[match[1]]:
        raise ValueError(
            f"{module}: no diffusers LoRA name for it; Flux LoRA files hold the Linear layers of "
            "double_blocks and single_blocks"
        )
    kind = "transformer_blocks" if match[1] == "double_blocks" else "single_transformer_blocks"
    return tuple(f"{kind}.{match[2]}.{part}" for part in rules[match[1]][match[3]])


def row_split(module: str, up: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    """lora_B rows of a fused module cut into its parts: q, k, v (and the MLP's rest for
    `linear1`, whose input width is the model width)."""
    parts = len(diffusers_modules(module))
    if parts == 1:
        return (up,)
    if parts == 3:
        return up.chunk(3)
    return up.split([in_features] * 3 + [up.shape[0] - 3 * in_features])


Adapters = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]


def to_kohya(adapters: Adapters, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{module: (down, up, alpha)} -> a kohya LoRA state dict."""
    state = {}
    for module, (down, up, alpha) in adapters.items():
        name = kohya_name(module)
        state[f"{name}.lora_down.weight"] = down
        state[f"{name}.lora_up.weight"] = up
        state[f"{name}.alpha"] = torch.tensor(float(alpha))
    return {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in state.items()}


def from_kohya(state: Mapping[str, torch.Tensor], modules: Iterable[str]) -> dict:
    """A kohya Flux LoRA state dict -> {module: (down, up, alpha)} for the model's `modules`;
    an unknown key is one clear error."""

    def unknown(name: str) -> str:
        if "guidance_in" in name:
            return (
                f"LoRA file: {name} is for FLUX.1-dev's guidance input; this model has none "
                "(schnell): use a LoRA trained on schnell, or a dev base"
            )
        return f"LoRA file: {name} names no Linear layer of this Flux model"

    return read_kohya(state, kohya_modules(modules), unknown)


def read_kohya(state: Mapping[str, torch.Tensor], known: Mapping[str, str], unknown) -> dict:
    """{module: (down, up, alpha)} of a kohya file whose names `known` maps to modules (alpha
    defaults to the rank, kohya's rule); a name it lacks is `unknown(name)`'s one-line error."""
    adapters = {}
    for key in state:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key.removesuffix(".lora_down.weight")
        if name not in known:
            raise ValueError(unknown(name))
        down = state[key]
        alpha = state.get(f"{name}.alpha", torch.tensor(float(down.shape[0])))
        adapters[known[name]] = (down, state[f"{name}.lora_up.weight"], float(alpha))
    return adapters


def to_diffusers(adapters: Adapters) -> dict[str, torch.Tensor]:
    """{module: (down, up, alpha)} -> diffusers' Flux LoRA state dict (`load_lora_weights`)."""
    return diffusers_state(adapters, diffusers_modules, row_split)


def diffusers_state(adapters: Adapters, modules_of, split) -> dict[str, torch.Tensor]:
    """diffusers' LoRA names: alpha folded into B (diffusers has no alpha); a fused layer
    (`qkv`) becomes its diffusers modules (`modules_of(module)`), B's rows cut by
    `split(module, up, in_features)`, A shared."""
    state = {}
    for module, (down, up, alpha) in adapters.items():
        up = up.float() * (alpha / down.shape[0])
        parts = modules_of(module)
        for part, rows in zip(parts, split(module, up, down.shape[1]), strict=True):
            key = DIFFUSERS_PREFIX + part
            state[f"{key}.lora_A.weight"] = down.detach().float().clone()
            state[f"{key}.lora_B.weight"] = rows.detach().clone()
    return {k: v.contiguous() for k, v in state.items()}


def peft_adapters(backbone: nn.Module, adapter: str = "default") -> dict:
    """{module: (down, up, alpha)} of the peft LoRA layers on a Flux backbone (or a
    LatentDiffusion holding one)."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, layer in backbone.named_modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            down = layer.lora_A[adapter].weight.detach()
            up = layer.lora_B[adapter].weight.detach()
            found[bare(name)] = (down, up, float(layer.lora_alpha[adapter]))
    return found
