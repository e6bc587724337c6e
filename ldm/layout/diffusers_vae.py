"""The KL autoencoder's weight names: original (CompVis `first_stage_model` / a VAE file) <->
diffusers' `AutoencoderKL` (`diffusion_pytorch_model.safetensors`).

The same tensors under other names, and the attention's 1x1 convolutions stored as linear
layers: `encoder.down.1.block.0.conv1.weight` <-> `encoder.down_blocks.1.resnets.0.conv1.weight`,
`decoder.up.{i}` <-> `decoder.up_blocks.{levels - 1 - i}` (diffusers counts the decoder's levels
from the bottom), `mid.block_{1,2}` <-> `mid_block.resnets.{0,1}`, `mid.attn_1.{norm,q,k,v,proj_out}`
<-> `mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}`, `nin_shortcut` <->
`conv_shortcut`, `norm_out` <-> `conv_norm_out`. Files of diffusers before 0.14 name the
attention `query/key/value/proj_attn`; they are read too. `quant_conv` / `post_quant_conv` keep
their names, and SD 3/3.5's VAE has neither (diffusers' `use_quant_conv: false`).
"""

import re
from collections.abc import Mapping

import torch

ATTENTION = {
    "norm.": "group_norm.",
    "q.": "to_q.",
    "k.": "to_k.",
    "v.": "to_v.",
    "proj_out.": "to_out.0.",
}
OLD_ATTENTION = {"query.": "to_q.", "key.": "to_k.", "value.": "to_v.", "proj_attn.": "to_out.0."}


def is_diffusers_vae(state: Mapping) -> bool:
    return any(k.startswith("encoder.down_blocks.") for k in state)


def _levels(state: Mapping, pattern: str) -> int:
    found = {int(m[1]) for k in state if (m := re.match(pattern, k))}
    if not found:
        raise KeyError("not a KL autoencoder state dict: no encoder levels")
    return max(found) + 1


def diffusers_name(name: str, levels: int) -> str:
    """An original VAE weight name -> diffusers' (names outside the encoder/decoder unchanged)."""
    part, _, rest = name.partition(".")
    if part not in ("encoder", "decoder"):
        return name
    flip = (lambda i: levels - 1 - int(i)) if part == "decoder" else int
    rules = (
        (r"^(down|up)\.(\d+)\.block\.(\d+)\.", lambda m: f"{m[1]}_blocks.{flip(m[2])}.resnets.{m[3]}."),
        (r"^down\.(\d+)\.downsample\.", lambda m: f"down_blocks.{m[1]}.downsamplers.0."),
        (r"^up\.(\d+)\.upsample\.", lambda m: f"up_blocks.{flip(m[1])}.upsamplers.0."),
        (r"^mid\.block_(\d)\.", lambda m: f"mid_block.resnets.{int(m[1]) - 1}."),
        (r"^norm_out\.", lambda m: "conv_norm_out."),
    )  # fmt: skip
    for pattern, repl in rules:
        rest = re.sub(pattern, repl, rest)
    rest = rest.replace("nin_shortcut.", "conv_shortcut.")
    if rest.startswith("mid.attn_1."):
        leaf = rest.removeprefix("mid.attn_1.")
        head = next(k for k in ATTENTION if leaf.startswith(k))
        rest = "mid_block.attentions.0." + ATTENTION[head] + leaf.removeprefix(head)
    return f"{part}.{rest}"


def to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original VAE weights (bare names) -> diffusers `AutoencoderKL` weights."""
    levels = _levels(state, r"encoder\.down\.(\d+)\.")
    out = {}
    for name, tensor in state.items():
        new = diffusers_name(name, levels)
        if ".attentions.0.to_" in new and new.endswith("weight"):
            tensor = tensor.reshape(tensor.shape[:2])  # (C, C, 1, 1) conv -> (C, C) linear
        out[new] = tensor
    return out


def from_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers `AutoencoderKL` weights -> original VAE names (the inverse of `to_diffusers`)."""
    state = dict(state)
    for key in list(state):  # diffusers < 0.14 attention names
        for old, new in OLD_ATTENTION.items():
            if f".attentions.0.{old}" in key:
                state[key.replace(f".attentions.0.{old}", f".attentions.0.{new}")] = state.pop(key)
    levels = _levels(state, r"encoder\.down_blocks\.(\d+)\.")
    original = {}
    for name in _original_names(levels, state):
        original[diffusers_name(name, levels)] = name
    unknown = sorted(set(state) - set(original))
    if unknown:
        raise KeyError(f"not a diffusers AutoencoderKL state dict: unexpected {unknown[:3]}")
    out = {}
    for key, tensor in state.items():
        if ".attentions.0.to_" in key and key.endswith("weight") and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]  # linear -> 1x1 conv
        out[original[key]] = tensor
    return out


def _original_names(levels: int, state: Mapping) -> list[str]:
    """Every original name a VAE of `levels` levels could have (enough to invert the rules)."""
    blocks = 1 + max(
        int(m[1]) for k in state if (m := re.search(r"_blocks\.\d+\.resnets\.(\d+)\.", k))
    )
    leaves = ("norm1", "conv1", "norm2", "conv2", "nin_shortcut")
    names = ["quant_conv", "post_quant_conv"]
    for part, level in (("encoder", "down"), ("decoder", "up")):
        names += [f"{part}.{x}" for x in ("conv_in", "conv_out", "norm_out")]
        for i in range(levels):
            names += [f"{part}.{level}.{i}.block.{j}.{x}" for j in range(blocks) for x in leaves]
            names.append(f"{part}.{level}.{i}.{level}sample.conv")
        names += [f"{part}.mid.block_{b}.{x}" for b in (1, 2) for x in leaves]
        names += [f"{part}.mid.attn_1.{x}" for x in ("norm", "q", "k", "v", "proj_out")]
    return [f"{n}.{kind}" for n in names for kind in ("weight", "bias")]


def diffusers_config(
    state: Mapping[str, torch.Tensor], scaling_factor: float, size: int, shift_factor: float = 0.0
) -> dict:
    """diffusers' `AutoencoderKL` config (config.json) of original VAE weights, read from their
    shapes and names; `scaling_factor` (0.18215 for SD 1.x/2.x, 1.5305 for SD3), `shift_factor`
    (SD3: 0.0609; diffusers' latents are (z - shift) * scale as ours) and `size` are not in the
    weights."""
    quant_conv = "quant_conv.weight" in state
    levels = _levels(state, r"encoder\.down\.(\d+)\.")
    blocks = _levels(state, r"encoder\.down\.0\.block\.(\d+)\.")
    return {
        "_class_name": "AutoencoderKL",
        "in_channels": state["encoder.conv_in.weight"].shape[1],
        "out_channels": state["decoder.conv_out.weight"].shape[0],
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": [
            state[f"encoder.down.{i}.block.{blocks - 1}.conv2.weight"].shape[0]
            for i in range(levels)
        ],
        "layers_per_block": blocks,
        "latent_channels": state["decoder.conv_in.weight"].shape[1],
        "norm_num_groups": 32,  # ldm.autoencoder.normalize
        "act_fn": "silu",
        "sample_size": size,
        "scaling_factor": scaling_factor,
        # diffusers writes null for "no shift" (SD 1.x/2.x/XL), as its own configs do
        "shift_factor": shift_factor or None,
        "use_quant_conv": quant_conv,
        "use_post_quant_conv": "post_quant_conv.weight" in state,
    }
