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


# --- diffusers-format files back to kohya names (what `read_kohya` takes) -----------------------

LORA_ADAPTER_METADATA = "lora_adapter_metadata"  # diffusers' safetensors key (lora_base.py)
_DIFFUSERS_KEY = re.compile(
    r"^(?:transformer\.)?(?P<part>(?P<blocks>\w+)\.(?P<n>\d+)\.(?P<module>.+))"
    r"\.(?P<kind>lora_A\.weight|lora_B\.weight|alpha)$"
)
MLP_RATIO = 4  # Flux.1's MLP width over the model width: linear1's rows after q, k and v


def flux_part_rows(module: str, in_features: int) -> list[int]:
    """The rows of each diffusers part of a fused Flux module: q, k, v (and linear1's MLP)."""
    if module.endswith("linear1"):
        return [in_features] * 3 + [MLP_RATIO * in_features]
    return [in_features] * 3


def kohya_from_diffusers(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """A diffusers-format Flux LoRA (`FluxPipeline.save_lora_weights`:
    `transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, its safetensors `metadata`
    optional) -> the kohya state dict `read_kohya` takes
    (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`)."""
    rules = {
        "transformer_blocks": ("double_blocks", DOUBLE_BLOCK),
        "single_transformer_blocks": ("single_blocks", SINGLE_BLOCK),
    }
    return fuse_diffusers(state, metadata, rules, flux_part_rows, "Flux")


def fuse_diffusers(state, metadata, rules, part_rows, model: str) -> dict[str, torch.Tensor]:
    """diffusers' LoRA parts -> one kohya adapter per our (fused) module.

    `rules`: diffusers block list -> (our block list, {our module: its diffusers parts in row
    order}); `part_rows(module, in_features)`: the rows of each part of a fused module. A part's
    scale (its `.alpha` / rank, else peft's alpha from the file's diffusers metadata, else 1:
    diffusers' rule) goes into its B. Parts sharing one A (our own export) keep it: down = A, up
    = the Bs stacked. Parts with their own A (a LoRA trained in diffusers) become one adapter of
    the summed rank: down = the As stacked, up = the Bs block-diagonal, so each part's update
    lands on its own rows; a part the file lacks gets zero rows. alpha = rank: the scale is in up.
    """
    where = {}  # diffusers (block list, part) -> (our block list, our module, row index, parts)
    for theirs, (ours, modules) in rules.items():
        for module, parts in modules.items():
            for index, part in enumerate(parts):
                where[theirs, part] = (ours, module, index, len(parts))
    peft = _peft_config(metadata)
    found: dict[tuple[str, int], dict[int, dict]] = {}
    for key, value in state.items():
        match = _DIFFUSERS_KEY.match(key)
        if not match or (match["blocks"], match["module"]) not in where:
            raise ValueError(
                f"LoRA file: {key} names no Linear layer of this {model} model's blocks (a "
                "diffusers-format LoRA for another model family?)"
            )
        ours, module, index, count = where[match["blocks"], match["module"]]
        parts = found.setdefault((f"{ours}.{match['n']}.{module}", count), {})
        parts.setdefault(index, {"name": match["part"]})[match["kind"]] = value
    out = {}
    for (module, count), parts in found.items():
        scaled = {}  # row index -> (A, B * scale)
        for index, part in sorted(parts.items()):
            down, up = part["lora_A.weight"].float(), part["lora_B.weight"].float()
            scaled[index] = (down, up * _scale(part, down.shape[0], peft))
        downs = [down for down, _ in scaled.values()]
        if len(scaled) == count and all(torch.equal(d, downs[0]) for d in downs):
            down, up = downs[0], torch.cat([up for _, up in scaled.values()])
        else:
            rows = part_rows(module, downs[0].shape[1]) if count > 1 else [scaled[0][1].shape[0]]
            down = torch.cat(downs)
            up = torch.zeros(sum(rows), down.shape[0])
            column = 0
            for index, (_, part_up) in scaled.items():
                top, rank = sum(rows[:index]), part_up.shape[1]
                up[top : top + rows[index], column : column + rank] = part_up
                column += rank
        name = kohya_name(module)
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))
    return out


def _peft_config(metadata: Mapping[str, str] | None) -> dict:
    """The transformer's LoraConfig fields diffusers stores in a file's metadata (or {})."""
    import json

    raw = (metadata or {}).get(LORA_ADAPTER_METADATA)
    if not raw:
        return {}
    packed = json.loads(raw)
    return {
        k.removeprefix("transformer."): v for k, v in packed.items() if k.startswith("transformer.")
    }


def _scale(part: Mapping, rank: int, peft: Mapping) -> float:
    """alpha / rank of one diffusers part: its own `.alpha` tensor, else peft's rule (the
    `alpha_pattern` entry matching its name, else `lora_alpha`; rsLoRA divides by sqrt(rank)),
    else 1 (diffusers' default: alpha = rank)."""
    if "alpha" in part:
        return float(part["alpha"]) / rank
    if not peft:
        return 1.0
    alpha = peft.get("lora_alpha", rank)
    for pattern, value in (peft.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", part["name"]):
            alpha = value
    return alpha / (rank**0.5 if peft.get("use_rslora") else rank)
