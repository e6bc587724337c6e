"""scripts/benchmark.py's mmdit section: an SD 3.5 Medium-structure MMDiT training step, ours
(ldm.mmdit) against diffusers' SD3Transformer2DModel (issue 33 item 9), speed and peak memory.

SD 3.5 Medium (MMDiT-X: QK RMSNorm, the image-only `attn2` in the first blocks) at its width
1536 (24 heads of 64), context 4096 and pooled 2048, with 2 joint blocks instead of 24 (block 0
with attn2, block 1 the pre_only last one) and a 64^2-patch position table instead of 384^2;
batch 1 of 64x64x16 latents (1024 image tokens, a 512 px image) and 154 text tokens (77 CLIP +
77 T5; the pipeline's default T5 length is 256). diffusers' SD3Transformer2DModel in the same structure holds our
weights (diffusers' own single-file converter). Both take the same inputs and the same fused
AdamW (ldm.optim), fp32, flow-matching MSE on the velocity; they take turns step by step
(`--cpu-seconds`: CPU seconds on one thread, for a shared machine). The peak memory of a step is
measured for each side in its own process (RSS on CPU), and ours / diffusers of the step's own
part above the memory before it (weights, AdamW state: the same on both sides).

    python scripts/benchmark.py --only mmdit --steps 3 --warmup 1
"""

from __future__ import annotations

import sys

import bench_backbone
from bench_backbone import randomise

NETWORK = dict(
    depth=2,
    hidden_size=1536,
    num_heads=24,
    pos_embed_max_size=64,
    qk_norm=True,
    dual_attention_layers=[0],
)
BATCH, LATENT, TOKENS = 1, 64, 154
TITLE = (
    f"SD 3.5 Medium-structure MMDiT train step (batch {BATCH}, {LATENT}x{LATENT}x16, {TOKENS} "
    "text tokens, width 1536, 2 joint blocks)"
)


def build_models(device, network=NETWORK):
    """Our MMDiT and diffusers' SD3Transformer2DModel with the same weights."""
    import torch
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    from ldm.layout import sd3
    from ldm.mmdit import MMDiT

    torch.manual_seed(0)
    ours = MMDiT(**network)
    randomise(ours)
    theirs = SD3Transformer2DModel(
        sample_size=ours.image_size,
        patch_size=ours.patch_size,
        in_channels=ours.in_channels,
        out_channels=ours.out_channels,
        num_layers=network["depth"],
        attention_head_dim=network["hidden_size"] // network["num_heads"],
        num_attention_heads=network["num_heads"],
        joint_attention_dim=ours.context_embedder.in_features,
        caption_projection_dim=network["hidden_size"],
        pooled_projection_dim=ours.y_embedder.mlp[0].in_features,
        pos_embed_max_size=network["pos_embed_max_size"],
        qk_norm="rms_norm" if network.get("qk_norm") else None,
        dual_attention_layers=tuple(network.get("dual_attention_layers", ())),
    )
    # The single-file layout under Stability's prefix, as the converter reads it.
    state = {sd3.BACKBONE + k: v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(convert_sd3_transformer_checkpoint_to_diffusers(state), strict=True)
    return ours.to(device).train(), theirs.to(device).train()


def inputs(device, network=NETWORK, batch=BATCH, latent=LATENT, tokens=TOKENS):
    """x, t, the text tokens, the pooled embedding, the target (scripts/gpu_bench/families.py
    asks for other sizes)."""
    import torch

    context_dim = network.get("context_dim", 4096)
    pooled_dim = network.get("pooled_dim", 2048)
    channels = network.get("in_channels", 16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, latent, latent, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    context = torch.randn(batch, tokens, context_dim, generator=g)
    pooled = torch.randn(batch, pooled_dim, generator=g)
    target = torch.randn(x.shape, generator=g)
    return [v.to(device) for v in (x, t, context, pooled, target)]


def forward(model, batch):
    """(B, 16, H, W) velocity; diffusers' side called as StableDiffusion3Pipeline calls it."""
    x, t, context, pooled, _ = batch
    if type(model).__name__ != "SD3Transformer2DModel":
        return model(x, t, {"crossattn": context, "vector": pooled})
    return model(
        hidden_states=x,
        encoder_hidden_states=context,
        pooled_projections=pooled,
        timestep=t,
        return_dict=False,
    )[0]


def mmdit_section(args, device, network=NETWORK) -> list[str]:
    return bench_backbone.section(sys.modules[__name__], args, device, network, memory=True)


if __name__ == "__main__":  # alone: benchmark.py's mmdit table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(mmdit_section)
