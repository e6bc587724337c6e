"""scripts/benchmark.py's flux section: a Flux.1-structure training step, ours against diffusers'.

Flux.1-dev (ldm.flux) at reduced size: width 768 (6 heads of 128, RoPE axes 16/56/56 as
released), 2 double-stream and 4 single-stream blocks instead of 19 and 38, guidance input, T5
width 4096 and CLIP-L 768 kept; batch 1 of 32x32x16 latents (256 image tokens, a 512 px image)
and 64 text tokens. diffusers' FluxTransformer2DModel in the same structure holds our weights
(diffusers' own single-file converter, run with the reduced width in place of its hard-coded
3072). Both take the same inputs - diffusers' as FluxPipeline packs them, with its position ids -
and the same fused AdamW (ldm.optim), fp32, flow-matching MSE on the velocity; they take turns
step by step.

    python scripts/benchmark.py --only flux --steps 3 --warmup 1
"""

from __future__ import annotations

import inspect
import sys

import bench_backbone
from bench_backbone import randomise

NETWORK = dict(
    depth=2,
    depth_single_blocks=4,
    hidden_size=768,
    num_heads=6,
    guidance_embed=True,
)
BATCH, LATENT, TOKENS = 1, 32, 64
TITLE = (
    f"Flux.1-dev-structure train step (batch {BATCH}, {LATENT}x{LATENT}x16, {TOKENS} text "
    "tokens, width 768, 2 double + 4 single blocks)"
)


def diffusers_flux_converter(width: int):
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers, its released width
    (`inner_dim = 3072`, where it cuts `single_blocks.N.linear1`) replaced by `width`."""
    from diffusers.loaders import single_file_utils

    convert = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    source = inspect.getsource(convert)
    if source.count("inner_dim = 3072") != 1:
        raise RuntimeError("diffusers' Flux converter changed: revisit diffusers_flux_converter")
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), namespace)  # noqa: S102
    return namespace[convert.__name__]


def build_models(device, network=NETWORK):
    """Our Flux and diffusers' FluxTransformer2DModel with the same weights."""
    import torch
    from diffusers import FluxTransformer2DModel

    from ldm.flux import Flux

    torch.manual_seed(0)
    ours = Flux(**network)
    randomise(ours)
    theirs = FluxTransformer2DModel(
        in_channels=4 * network.get("in_channels", 16),
        num_layers=network["depth"],
        num_single_layers=network["depth_single_blocks"],
        attention_head_dim=network["hidden_size"] // network["num_heads"],
        num_attention_heads=network["num_heads"],
        guidance_embeds=True,
        axes_dims_rope=tuple(network.get("axes_dim", (16, 56, 56))),  # BFL's RoPE axes
    )
    convert = diffusers_flux_converter(network["hidden_size"])
    theirs.load_state_dict(convert(dict(ours.state_dict())), strict=True)
    return ours.to(device).train(), theirs.to(device).train()


def inputs(device, network=NETWORK, batch=BATCH, latent=LATENT, tokens=TOKENS):
    """x, t, the T5 tokens, pooled CLIP-L, guidance 3.5, the target (scripts/gpu_bench/
    families.py asks for other sizes)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 16, latent, latent, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    context = torch.randn(batch, tokens, 4096, generator=g)
    pooled = torch.randn(batch, 768, generator=g)
    guidance = torch.full((batch,), 3.5)
    target = torch.randn(x.shape, generator=g)
    return [v.to(device) for v in (x, t, context, pooled, guidance, target)]


def forward(model, batch):
    """(B, 16, H, W) velocity; diffusers' side packed and unpacked as FluxPipeline does."""
    import torch
    from diffusers import FluxPipeline

    x, t, context, pooled, guidance, _ = batch
    if type(model).__name__ != "FluxTransformer2DModel":
        return model(x, t, {"crossattn": context, "vector": pooled, "guidance": guidance})
    b, c, h, w = x.shape
    ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
    out = model(
        hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
        encoder_hidden_states=context,
        pooled_projections=pooled,
        timestep=t / 1000,
        img_ids=ids,
        txt_ids=torch.zeros(context.shape[1], 3, device=x.device),
        guidance=guidance,
        return_dict=False,
    )[0]  # (B, N, 64)
    return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


def flux_section(args, device) -> list[str]:
    return bench_backbone.section(sys.modules[__name__], args, device, NETWORK)


if __name__ == "__main__":  # alone: benchmark.py's flux table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(flux_section)
