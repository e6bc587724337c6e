"""scripts/benchmark.py's sdxl section: an SDXL-structure UNet training step, ours against diffusers'.

SDXL's UNet (Podell et al. 2023) at reduced width: 3 levels, 2 ResBlocks each, attention at the
two lower resolutions with transformer depth [1, 2, 4] (SDXL: [1, 2, 10]), 64-channel heads,
linear projections, cross-attention on a 77 x 2048 context, and the `label_emb` MLP on the 2816-d
`vector` (pooled text 1280 + 6 size / crop numbers x 256 Fourier channels); model_channels 64
instead of 320, batch 2 of 32x32 latents. diffusers' `UNet2DConditionModel` in the same structure (addition_embed_type
"text_time") is built by diffusers' own single-file converters from our config and holds our
weights. Both steps take the same inputs - ours embeds the six size numbers into `vector` as our
conditioner does, diffusers' does it inside its forward (`add_time_proj`) - and the same fused
AdamW, fp32; they take turns step by step.

    python scripts/benchmark.py --only sdxl --steps 3 --warmup 1
"""

from __future__ import annotations

import sys
from pathlib import Path

import bench_backbone
from bench_backbone import randomise
from omegaconf import OmegaConf

# Stability-AI's inference config, shipped unchanged
SGM_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sdxl" / "sd_xl_base.yaml"
# SDXL: 320, [1, 2, 10]. Width 64 keeps the two models with their AdamW states (78 M parameters
# each; at width 128, 248 M: 8 GB together) in a few GB of a CPU machine.
NETWORK = {"model_channels": 64, "transformer_depth": [1, 2, 4]}
BATCH, LATENT, TOKENS, CONTEXT, POOLED, SIZE_CHANNELS = 2, 32, 77, 2048, 1280, 256
TITLE = f"SDXL-structure UNet train step (batch {BATCH}, {LATENT}x{LATENT}, ch 64, depth 1/2/4)"


def sdxl_config(network: dict = NETWORK) -> dict:
    config = OmegaConf.load(SGM_CONFIG)
    config.model.params.network_config.params.update(network)
    config.model.params.network_config.params.use_checkpoint = False
    return OmegaConf.to_container(config, resolve=True)


def build_models(device, network=NETWORK):
    """Our SDXL UNet and diffusers' text_time UNet2DConditionModel with the same weights."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    from ldm.layout import original
    from ldm.util import instantiate_from_config

    config = sdxl_config(network)
    torch.manual_seed(0)
    ours = instantiate_from_config(config["model"]["params"]["network_config"])
    randomise(ours)
    state = {original.unet_key(k): v for k, v in ours.state_dict().items()}
    diffusers_config = create_unet_diffusers_config_from_ldm(config, state)
    assert diffusers_config["addition_embed_type"] == "text_time"  # SDXL's, from context 2048
    theirs = UNet2DConditionModel(**diffusers_config)
    theirs.load_state_dict(convert_ldm_unet_checkpoint(state, diffusers_config), strict=True)
    return ours.to(device).train(), theirs.to(device).train()


def inputs(device, network=NETWORK):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 4, LATENT, LATENT, generator=g)
    t = torch.randint(0, 1000, (BATCH,), generator=g)
    context = torch.randn(BATCH, TOKENS, CONTEXT, generator=g)
    pooled = torch.randn(BATCH, POOLED, generator=g)
    # original size, crop (top, left), target size: diffusers' add_time_ids order
    time_ids = torch.tensor([[1024.0, 768, 0, 0, 1024, 1024]]).repeat(BATCH, 1)
    target = torch.randn(x.shape, generator=g)
    return [v.to(device) for v in (x, t, context, pooled, time_ids, target)]


def forward(model, batch):
    import torch

    from ldm.unet import timestep_embedding

    x, t, context, pooled, time_ids, _ = batch
    if type(model).__name__ == "UNet2DConditionModel":
        added = {"text_embeds": pooled, "time_ids": time_ids}
        return model(x, t, encoder_hidden_states=context, added_cond_kwargs=added).sample
    # our conditioner's size embedders (ConcatTimestepEmbedderND): each number -> 256 channels
    sizes = timestep_embedding(time_ids.reshape(-1), SIZE_CHANNELS).reshape(len(x), -1)
    return model(x, t, {"crossattn": context, "vector": torch.cat([pooled, sizes], dim=1)})


def sdxl_section(args, device) -> list[str]:
    return bench_backbone.section(sys.modules[__name__], args, device, NETWORK)


if __name__ == "__main__":  # alone: benchmark.py's sdxl table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(sdxl_section)
