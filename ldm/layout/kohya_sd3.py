"""SD3 / SD 3.5 LoRA files: kohya-ss's format (sd-scripts `networks/lora_sd3.py`, read by ComfyUI,
Forge, diffusers) and diffusers' / peft's format, from our adapters on ldm.mmdit.MMDiT.

An adapter is (down, up, alpha) on one Linear of the backbone, named as Stability's single file
names the module (`joint_blocks.0.x_block.attn.qkv`); its update is up @ down * alpha / rank.

kohya: the module name with `.` -> `_` under `lora_unet_` (ComfyUI maps `lora_unet_` + every
    `diffusion_model.` weight's name that way): `lora_unet_joint_blocks_0_x_block_attn_qkv
    .lora_down.weight` (rank, in), `.lora_up.weight` (out, rank), `.alpha` (0-dim); the fused
    q/k/v stays fused, as Stability's weights.
diffusers: `transformer.<SD3Transformer2DModel module>.lora_A.weight` / `.lora_B.weight`, alpha /
    rank folded into lora_B (no alpha in the file: diffusers then scales by 1). diffusers splits the
    fused q/k/v (its single-file converter cuts `qkv.weight` in three, q, k, v), so a qkv adapter
    becomes three sharing lora_A, lora_B cut row-wise in thirds.
"""

import re
from collections.abc import Iterable, Mapping

import torch

from ldm.layout.kohya_flux import (
    KOHYA_PREFIX,
    bare,
    diffusers_state,
    fuse_diffusers,
    kohya_modules,
    peft_adapters,
    read_kohya,
    to_kohya,
)

__all__ = [
    "from_kohya",
    "peft_adapters",
    "to_diffusers",
    "to_kohya",
    "diffusers_modules",
    "kohya_from_diffusers",
]

# (stream, module) -> diffusers module(s) under `transformer_blocks.N.` (diffusers'
# convert_sd3_transformer_checkpoint_to_diffusers); several = the fused rows in order.
JOINT_BLOCK = {
    ("x_block", "attn.qkv"): ("attn.to_q", "attn.to_k", "attn.to_v"),
    ("x_block", "attn.proj"): ("attn.to_out.0",),
    ("x_block", "attn2.qkv"): ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
    ("x_block", "attn2.proj"): ("attn2.to_out.0",),
    ("x_block", "mlp.fc1"): ("ff.net.0.proj",),
    ("x_block", "mlp.fc2"): ("ff.net.2",),
    ("context_block", "attn.qkv"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ("context_block", "attn.proj"): ("attn.to_add_out",),
    ("context_block", "mlp.fc1"): ("ff_context.net.0.proj",),
    ("context_block", "mlp.fc2"): ("ff_context.net.2",),
}
_BLOCK = re.compile(r"^joint_blocks\.(\d+)\.(x_block|context_block)\.(.+)$")


def kohya_name(module: str) -> str:
    """`joint_blocks.0.x_block.attn.qkv` -> `lora_unet_joint_blocks_0_x_block_attn_qkv`."""
    return KOHYA_PREFIX + bare(module).replace(".", "_")


def diffusers_modules(module: str) -> tuple[str, ...]:
    """A joint-block module -> its diffusers module(s), fused rows in order."""
    match = _BLOCK.match(bare(module))
    parts = JOINT_BLOCK.get((match[2], match[3])) if match else None
    if parts is None:
        raise ValueError(
            f"{module}: no diffusers LoRA name for it; SD3 LoRA files hold the attention and MLP "
            "Linear layers of the joint blocks"
        )
    return tuple(f"transformer_blocks.{match[1]}.{part}" for part in parts)


Adapters = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]


def from_kohya(state: Mapping[str, torch.Tensor], modules: Iterable[str]) -> dict:
    """A kohya SD3 LoRA state dict -> {module: (down, up, alpha)} for the model's `modules`;
    an unknown key is one clear error."""

    def unknown(name: str) -> str:
        return (
            f"LoRA file: {name} names no Linear layer of this SD3 model (a LoRA for "
            "another model family or size?)"
        )

    return read_kohya(state, kohya_modules(modules), unknown)


def to_diffusers(adapters: Adapters) -> dict[str, torch.Tensor]:
    """{module: (down, up, alpha)} -> diffusers' SD3 LoRA state dict (`load_lora_weights`): a
    fused qkv's B rows cut in three equal parts."""
    return diffusers_state(adapters, diffusers_modules, _equal_rows)


def _equal_rows(module: str, up: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    return up.chunk(len(diffusers_modules(module)))


def kohya_from_diffusers(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """A diffusers-format SD3 LoRA (`StableDiffusion3Pipeline.save_lora_weights`:
    `transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, its safetensors `metadata`
    optional) -> the kohya state dict `read_kohya` takes
    (`lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight`); q, k and v fused again."""
    modules = {f"{stream}.{module}": parts for (stream, module), parts in JOINT_BLOCK.items()}
    rules = {"transformer_blocks": ("joint_blocks", modules)}
    return fuse_diffusers(state, metadata, rules, _equal_part_rows, "SD3")


def _equal_part_rows(module: str, in_features: int) -> list[int]:
    return [in_features] * 3  # q, k, v: the model width each
