"""Stable Diffusion 3 / 3.5 key rules: Stability's single files and diffusers folders.

Our LatentDiffusion with an MMDiT backbone and the SD3 conditioner *is* the single-file layout
(Stability-AI/sd3.5 `sd3_infer.py` reads these names), so no renaming happens on load or save:
    model.diffusion_model.*   MMDiT (`ldm.mmdit`: joint_blocks.N.{x_block,context_block}.*)
    text_encoders.clip_l.transformer.*   transformers' CLIPTextModel (no projection)
    text_encoders.clip_g.transformer.*   CLIPTextModelWithProjection
    text_encoders.t5xxl.transformer.*    T5EncoderModel (the tied embed_tokens once, as shared)
    first_stage_model.*       the 16-channel VAE
tests/ldm/test_layout_sd3.py proves it with diffusers' own single-file converters.

A diffusers folder's components (StableDiffusion3Pipeline: transformer, text_encoder,
text_encoder_2, text_encoder_3, vae) come from diffusers' converters one way
(`to_diffusers`) and the inverse rules below the other (`from_diffusers`); both are bit-exact.
"""

from collections.abc import Iterable, Mapping

import torch

BACKBONE = "model.diffusion_model."
TEXT_ENCODERS = "text_encoders."
FIRST_STAGE = "first_stage_model."
CLIP_L, CLIP_G, T5 = (
    f"{TEXT_ENCODERS}{name}.transformer." for name in ("clip_l", "clip_g", "t5xxl")
)
# Keys only an SD3 file has: the joint blocks (bare, as in a transformer-only file, or under the
# backbone prefix) and the three text encoders.
SD3_MARKERS = ("joint_blocks.", BACKBONE + "joint_blocks.", TEXT_ENCODERS)
# diffusers' component name -> our prefix of its weights.
COMPONENTS = {
    "transformer": BACKBONE,
    "text_encoder": CLIP_L,
    "text_encoder_2": CLIP_G,
    "text_encoder_3": T5,
    "vae": FIRST_STAGE,
}


def is_sd3(keys: Iterable[str]) -> bool:
    """Whether state-dict keys are an SD3 / 3.5 model (or its bare MMDiT)."""
    return any(k.startswith(SD3_MARKERS) for k in keys)


def _under(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


# --- to diffusers: diffusers' own single-file converters -----------------------------------------


def to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Our (= Stability's) state dict -> {component: its diffusers state dict}; components the
    state lacks (a file without T5) are left out."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_sd3_t5_checkpoint_to_diffusers,
        convert_sd3_transformer_checkpoint_to_diffusers,
    )

    from ldm.layout import diffusers_vae

    out = {}
    backbone = _under(state, BACKBONE)
    if backbone:  # the converter pops what it reads: give it a copy
        out["transformer"] = convert_sd3_transformer_checkpoint_to_diffusers(dict(backbone))
    for component, prefix in (("text_encoder", CLIP_L), ("text_encoder_2", CLIP_G)):
        if any(k.startswith(prefix) for k in state):
            out[component] = convert_ldm_clip_checkpoint(dict(state), prefix)
    if "text_encoder" in out:  # SD3's CLIP-L has no projection: diffusers' identity stands in
        width = out["text_encoder"]["text_model.embeddings.token_embedding.weight"].shape[1]
        out["text_encoder"]["text_projection.weight"] = torch.eye(width)
    if any(k.startswith(T5) for k in state):
        t5 = convert_sd3_t5_checkpoint_to_diffusers(dict(state))
        t5.setdefault("encoder.embed_tokens.weight", t5["shared.weight"])
        out["text_encoder_3"] = t5
    vae = _under(state, FIRST_STAGE)
    if vae:
        out["vae"] = diffusers_vae.to_diffusers(vae)
    return out


# --- from diffusers: the inverse of convert_sd3_transformer_checkpoint_to_diffusers ----------------


def _swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    """diffusers' AdaLayerNormContinuous holds (scale, shift); Stability's final layer (shift,
    scale): the same swap both ways."""
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def transformer_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SD3Transformer2DModel's state dict -> MMDiT's (Stability names, no prefix)."""
    sd = dict(sd)
    out = {
        "pos_embed": sd.pop("pos_embed.pos_embed"),
        "x_embedder.proj.weight": sd.pop("pos_embed.proj.weight"),
        "x_embedder.proj.bias": sd.pop("pos_embed.proj.bias"),
        "context_embedder.weight": sd.pop("context_embedder.weight"),
        "context_embedder.bias": sd.pop("context_embedder.bias"),
        "final_layer.linear.weight": sd.pop("proj_out.weight"),
        "final_layer.linear.bias": sd.pop("proj_out.bias"),
        "final_layer.adaLN_modulation.1.weight": _swap_scale_shift(
            sd.pop("norm_out.linear.weight")
        ),
        "final_layer.adaLN_modulation.1.bias": _swap_scale_shift(sd.pop("norm_out.linear.bias")),
    }
    for ours, theirs in (("t_embedder", "timestep_embedder"), ("y_embedder", "text_embedder")):
        for i, linear in ((0, "linear_1"), (2, "linear_2")):
            for p in ("weight", "bias"):
                out[f"{ours}.mlp.{i}.{p}"] = sd.pop(f"time_text_embed.{theirs}.{linear}.{p}")
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    for i in range(depth):
        block, ours = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        # (their attention prefix, our stream, q/k/v names, their output projection)
        streams = [
            ("attn.", "x_block.attn.", ("to_q", "to_k", "to_v"), "attn.to_out.0", "norm_q", "norm_k"),
            ("attn.", "context_block.attn.", ("add_q_proj", "add_k_proj", "add_v_proj"),
             "attn.to_add_out", "norm_added_q", "norm_added_k"),
        ]  # fmt: skip
        if block + "attn2.to_q.weight" in sd:
            streams.append(("attn2.", "x_block.attn2.", ("to_q", "to_k", "to_v"),
                            "attn2.to_out.0", "norm_q", "norm_k"))  # fmt: skip
        for attn, stream, qkv, proj, norm_q, norm_k in streams:
            for p in ("weight", "bias"):
                out[f"{ours}{stream}qkv.{p}"] = torch.cat(
                    [sd.pop(f"{block}{attn}{name}.{p}") for name in qkv]
                )
                if block + f"{proj}.{p}" in sd:  # not in the last block's pre_only text stream
                    out[f"{ours}{stream}proj.{p}"] = sd.pop(f"{block}{proj}.{p}")
            for theirs, mine in ((norm_q, "ln_q"), (norm_k, "ln_k")):
                if f"{block}{attn}{theirs}.weight" in sd:  # SD 3.5's QK RMSNorm
                    out[f"{ours}{stream}{mine}.weight"] = sd.pop(f"{block}{attn}{theirs}.weight")
        for theirs, stream in (("norm1", "x_block"), ("norm1_context", "context_block")):
            for p in ("weight", "bias"):
                weight = sd.pop(f"{block}{theirs}.linear.{p}")
                if theirs == "norm1_context" and i == depth - 1:  # pre_only: AdaLayerNormContinuous
                    weight = _swap_scale_shift(weight)
                out[f"{ours}{stream}.adaLN_modulation.1.{p}"] = weight
        for theirs, stream in (("ff", "x_block"), ("ff_context", "context_block")):
            for net, fc in (("net.0.proj", "fc1"), ("net.2", "fc2")):
                for p in ("weight", "bias"):
                    key = f"{block}{theirs}.{net}.{p}"
                    if key in sd:
                        out[f"{ours}{stream}.mlp.{fc}.{p}"] = sd.pop(key)
    if sd:
        raise ValueError(f"SD3 transformer keys not understood: {sorted(sd)[:5]}")
    return out


def from_diffusers(components: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{component: diffusers state dict} -> our (= Stability's) state dict."""
    from ldm.layout import diffusers_vae

    out = {}
    for component, sd in components.items():
        prefix = COMPONENTS[component]
        if component == "transformer":
            sd = transformer_from_diffusers(sd)
        elif component in ("text_encoder", "text_encoder_2"):
            sd = {
                k: v
                for k, v in sd.items()
                if not k.startswith("text_model.embeddings.position_ids")
            }
            if component == "text_encoder":  # SD3's CLIP-L file has no projection
                sd.pop("text_projection.weight", None)
        elif component == "text_encoder_3":
            sd = {k: v for k, v in sd.items() if k != "encoder.embed_tokens.weight"}
        elif component == "vae":
            sd = diffusers_vae.from_diffusers(sd)
        out.update({prefix + k: v for k, v in sd.items()})
    return out
