"""A tiny SDXL: the original sgm inference config with toy widths (shared by the SDXL tests)."""

import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[1]
# Stability-AI generative-models configs/inference/sd_xl_base.yaml, shipped unchanged.
SGM_CONFIG = ROOT / "configs" / "sdxl" / "sd_xl_base.yaml"

# Toy sizes: CLIP-L 32 wide (2 layers, so "hidden 11" becomes hidden 1 = its penultimate),
# bigG 32 wide, size features of 8 channels: context 32 + 32, vector 32 + 3 * 2 * 8 = 80.
TEXT_WIDTH, SIZE_DIM = 32, 8
ADM_CHANNELS = TEXT_WIDTH + 3 * 2 * SIZE_DIM
CLIP_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


TINY_EMBEDDER_PARAMS = {
    # CLIP-L 2 layers: "hidden 11" (its penultimate) becomes hidden 1
    "FrozenCLIPEmbedder": {"config": CLIP_CONFIG, "layer_idx": 1},
    "FrozenOpenCLIPEmbedder2": {"width": 32, "layers": 2, "heads": 2, "embed_dim": TEXT_WIDTH},
    "ConcatTimestepEmbedderND": {"outdim": SIZE_DIM},
}


def tiny_emb_models(emb_models: list) -> list:
    """The conditioner's embedder list with toy sizes (a dotlist cannot index into a list, so
    the whole list is replaced)."""
    tiny = []
    for spec in emb_models:
        name = spec["target"].rsplit(".", 1)[-1]
        tiny.append(
            {**spec, "params": {**(spec.get("params") or {}), **TINY_EMBEDDER_PARAMS[name]}}
        )
    return tiny


def tiny_sdxl_overrides(model, params: str = "model.params") -> list:
    """Dotlist overrides shrinking an SDXL model config (sgm's or ours) to toy size (32 px)."""
    backbone = "network_config" if "network_config" in model["params"] else "backbone_config"
    unet, vae = f"{params}.{backbone}.params", f"{params}.first_stage_config.params.ddconfig"
    emb_models = OmegaConf.to_container(
        model["params"]["conditioner_config"]["params"]["emb_models"]
    )
    return [
        f"{unet}.model_channels=32",
        f"{unet}.channel_mult=[1,2,2]",
        f"{unet}.num_res_blocks=1",
        f"{unet}.attention_resolutions=[2,4]",
        f"{unet}.transformer_depth=[1,1,2]",
        f"{unet}.num_head_channels=16",
        f"{unet}.context_dim={2 * TEXT_WIDTH}",
        f"{unet}.adm_in_channels={ADM_CHANNELS}",
        f"{params}.conditioner_config.params.emb_models={json.dumps(tiny_emb_models(emb_models))}",
        f"{vae}.ch=32",
        f"{vae}.ch_mult=[1,2]",
        f"{vae}.num_res_blocks=1",
        f"{vae}.resolution=32",
    ]


def tiny_sdxl_config(extra: list | None = None) -> dict:
    """The original SDXL inference config at toy size, as a plain dict."""
    config = OmegaConf.load(SGM_CONFIG)
    dotlist = [*tiny_sdxl_overrides(config.model), *(extra or [])]
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(dotlist))
    return OmegaConf.to_container(config, resolve=True)


def tiny_sdxl(seed: int = 0, extra: list | None = None):
    """A tiny SDXL LatentDiffusion with random weights everywhere (no zero-init output conv)."""
    torch.manual_seed(seed)
    model = instantiate_from_config(tiny_sdxl_config(extra)["model"])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                std = 0.1 if param.dim() <= 1 else param[0].numel() ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model.eval()


def trained_scale_weights(model: torch.nn.Module, seed: int) -> None:
    """Norms ~1, biases ~0.2, weights ~1/sqrt(fan_in) (tests/e2e/test_diffusers_folder_e2e.py's
    rule, plus the 0-dim `logit_scale`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in model.modules():
            for name, param in sub.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=generator)
                if isinstance(sub, torch.nn.GroupNorm | torch.nn.LayerNorm):
                    param.copy_((1.0 if name == "weight" else 0.0) + 0.2 * noise)
                elif param.ndim <= 1:
                    param.copy_(0.2 * noise)
                else:
                    param.copy_(noise / param[0].numel() ** 0.5)
