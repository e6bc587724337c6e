"""Flux.1 weight files <-> our backbone (ldm.flux.Flux) names.

Our parameter names are BFL's own: `flux1-dev.safetensors` / `flux1-schnell.safetensors` hold
them bare (`double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1.weight`, `img_in.*`,
`time_in.in_layer.*`, `guidance_in.*` (dev only), `vector_in.*`, `txt_in.*`,
`final_layer.adaLN_modulation.1.*`). ComfyUI's and Forge's all-in-one checkpoints put the same
names under `model.diffusion_model.`, which is also where a LatentDiffusion keeps its backbone.
"""

from collections.abc import Mapping

import torch

BACKBONE = "model.diffusion_model."  # LatentDiffusion's backbone / single-file checkpoints
MARKERS = ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight")
GUIDANCE = "guidance_in.in_layer.weight"  # only dev (guidance-distilled) has it


def strip_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL file or an all-in-one checkpoint -> bare backbone names (other parts dropped)."""
    if any(k.startswith(BACKBONE) for k in state):
        return {k.removeprefix(BACKBONE): v for k, v in state.items() if k.startswith(BACKBONE)}
    return dict(state)


def is_flux(state: Mapping) -> bool:
    """A Flux.1 transformer, bare or under the backbone prefix."""
    return any(k.endswith(MARKERS) for k in state)


def variant(state: Mapping) -> str:
    """ "dev" (guidance input) or "schnell", read from a Flux state dict's keys."""
    return "dev" if any(k.endswith(GUIDANCE) for k in state) else "schnell"


def to_bfl_file(backbone_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our backbone's state dict -> the tensors of `flux1-*.safetensors` (the names already
    are BFL's; a LatentDiffusion's `model.diffusion_model.` is removed)."""
    return strip_prefix(backbone_state)


def to_checkpoint(backbone_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL file's tensors -> a LatentDiffusion's backbone keys (ComfyUI's single-file layout)."""
    return {BACKBONE + k: v for k, v in strip_prefix(backbone_state).items()}
