"""scripts/convert.py's Stable Diffusion 3 / 3.5 part: our (= Stability's single-file) state dict
to a diffusers `StableDiffusion3Pipeline` folder and back, the weights renamed by
ldm.layout.sd3 (diffusers' own converters one way, their inverse the other: bit-exact).

    python scripts/convert.py logs/<run>/checkpoints/last.ckpt --to-diffusers out/sd3-pipeline
    python scripts/convert.py out/sd3-pipeline model.safetensors      # a folder back to one file

The folder holds what `StableDiffusion3Pipeline.from_pretrained` loads: transformer
(SD3Transformer2DModel), vae (AutoencoderKL, 16 channels, scale / shift of the model), the CLIP-L
and bigG text encoders (CLIPTextModelWithProjection; CLIP-L's projection is the identity, as
diffusers' single-file loader makes it, since SD3 uses its pooled output unprojected), T5-XXL
when the model has one, their tokenizers (bigG's pads with "!", id 0, as SD3's tokenizer_2), and
FlowMatchEulerDiscreteScheduler with the model's shift (3.0 in the released SD3 configs and in
configs/sd3/sd3.5-*.yaml).
"""

from __future__ import annotations

import copy
from pathlib import Path


def transformer_config(backbone) -> dict:
    """SD3Transformer2DModel's config of our MMDiT (ldm.mmdit)."""
    from torch import nn

    blocks = backbone.joint_blocks
    attn = blocks[0].x_block.attn
    width = attn.qkv.in_features
    return {
        "sample_size": backbone.image_size,
        "patch_size": backbone.patch_size,
        "in_channels": backbone.in_channels,
        "out_channels": backbone.out_channels,
        "num_layers": len(blocks),
        "attention_head_dim": width // attn.num_heads,
        "num_attention_heads": attn.num_heads,
        "joint_attention_dim": backbone.context_embedder.in_features,
        "caption_projection_dim": width,
        "pooled_projection_dim": backbone.y_embedder.mlp[0].in_features,
        "pos_embed_max_size": backbone.pos_embed_max_size,
        "qk_norm": "rms_norm" if isinstance(attn.ln_q, nn.RMSNorm) else None,
        "dual_attention_layers": tuple(
            i for i, block in enumerate(blocks) if hasattr(block.x_block, "attn2")
        ),
    }


def _loaded(model_class, config, state: dict):
    """`model_class(config)` holding `state`: its parameters are never initialised (accelerate's
    empty weights), its computed buffers (position ids) are made as usual."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(**config) if isinstance(config, dict) else model_class(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def export_sd3(state: dict, original: dict, out_dir: Path) -> None:
    """Write a `StableDiffusion3Pipeline` folder of our SD3 state dict; `original`: the model's
    config (`{"model": {"target", "params"}}`)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    from ldm.layout import diffusers_vae, sd3
    from ldm.util import instantiate_from_config

    params = original["model"]["params"]
    with torch.device("meta"):  # the structure, the configs and the tokenizers
        model = instantiate_from_config(
            {**original["model"], "params": {**params, "ckpt_path": None}}
        )
    components = sd3.to_diffusers(state)
    conditioner = model.caption_conditioner
    clip_l_config = copy.deepcopy(conditioner.clip_l.transformer.config)
    clip_l_config.projection_dim = clip_l_config.hidden_size  # the identity projection
    vae_state = {
        k.removeprefix(sd3.FIRST_STAGE): v
        for k, v in state.items()
        if k.startswith(sd3.FIRST_STAGE)
    }
    scale, shift = model.latent_scaling
    vae_config = diffusers_vae.diffusers_config(
        vae_state, scale, params["first_stage_config"]["params"]["ddconfig"]["resolution"], shift
    )
    vae_config.pop("_class_name")
    tokenizer_2 = copy.deepcopy(conditioner.clip_g.tokenizer)
    tokenizer_2.pad_token = "!"  # id 0: open_clip / SD3's bigG pads with zeros
    t5 = conditioner.t5xxl
    pipeline = StableDiffusion3Pipeline(
        transformer=_loaded(
            SD3Transformer2DModel, transformer_config(model.denoiser), components["transformer"]
        ),
        vae=_loaded(AutoencoderKL, vae_config, components["vae"]),
        text_encoder=_loaded(
            CLIPTextModelWithProjection, clip_l_config, components["text_encoder"]
        ),
        tokenizer=conditioner.clip_l.tokenizer,
        text_encoder_2=_loaded(
            CLIPTextModelWithProjection,
            conditioner.clip_g.transformer.config,
            components["text_encoder_2"],
        ),
        tokenizer_2=tokenizer_2,
        text_encoder_3=None
        if t5 is None
        else _loaded(T5EncoderModel, t5.transformer.config, components["text_encoder_3"]),
        tokenizer_3=None if t5 is None else t5.tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=model.num_timesteps, shift=model.objective.times.shift
        ),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def folder_state(folder: Path, unsafe: bool = False) -> dict:
    """A `StableDiffusion3Pipeline` folder's weights in our (= Stability's) layout."""
    from ldm.layout import sd3
    from ldm.layout.diffusers import load_component

    components = {
        name: load_component(folder / name, unsafe)
        for name in sd3.COMPONENTS
        if (folder / name).is_dir()
    }
    return sd3.from_diffusers(components)


if __name__ == "__main__":  # alone: convert.py (its flags apply: --help); run, not imported,
    import runpy  # so that convert.py <-> convert_sd3.py is no import circle

    runpy.run_path(str(Path(__file__).with_name("convert.py")), run_name="__main__")
