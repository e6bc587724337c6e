"""The FLUX.1 VAE in configs/flux: BFL's `ae.safetensors` (16 channels, no quant_conv, latent
scale 0.3611 and shift 0.1159) is the first stage every Flux config builds and loads."""

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL as DiffusersAutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "flux").glob("*.yaml"))
# black-forest-labs/FLUX.1-dev vae/config.json (diffusers' AutoencoderKL arguments)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# A few names of BFL's ae.safetensors as BFL's src/flux/modules/autoencoder.py makes them.
BFL_NAMES = [
    "encoder.conv_in.weight",
    "encoder.down.0.block.0.norm1.weight",
    "encoder.down.1.block.0.nin_shortcut.weight",
    "encoder.down.2.downsample.conv.weight",
    "encoder.mid.attn_1.q.weight",
    "encoder.mid.attn_1.proj_out.weight",
    "encoder.norm_out.weight",
    "encoder.conv_out.weight",
    "decoder.mid.block_2.conv2.weight",
    "decoder.up.3.upsample.conv.weight",
    "decoder.up.0.block.2.conv1.weight",
    "decoder.conv_out.bias",
]


def first_stage(config: Path, **params):
    """The AutoencoderKL a Flux config builds (on the meta device: its names and shapes)."""
    vae = OmegaConf.to_container(OmegaConf.load(config).model.params.first_stage_config)
    vae["params"].update(params)
    with torch.device("meta"):
        return instantiate_from_config(vae)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_flux_configs_first_stage_has_the_flux_vae_factors(config):
    vae = first_stage(config)
    assert (vae.scale_factor, vae.shift_factor) == (0.3611, 0.1159)  # diffusers' Flux VAE config
    assert vae.latent_channels == 16 and not vae.use_quant_conv
    model = OmegaConf.load(config).model.params
    assert "scale_factor" not in model  # the CompVis argument would win over the VAE's own


def test_full_size_flux_vae_names_are_bfl_ae_names_diffusers_reads():
    """diffusers' single-file VAE converter (what `AutoencoderKL.from_single_file` runs on
    BFL's ae.safetensors) maps every one of our names into FLUX.1-dev's VAE, with no key of it
    missing; BFL's own names are among ours, with no quant_conv."""
    state = first_stage(CONFIGS[0]).state_dict()
    assert set(BFL_NAMES) <= set(state)
    assert not any("quant_conv" in k for k in state)
    converted = convert_ldm_vae_checkpoint(state, FLUX_VAE)
    assert len(converted) == len(state)  # every one of our tensors has a diffusers place
    with torch.device("meta"):
        theirs = DiffusersAutoencoderKL(**FLUX_VAE)
    own = theirs.state_dict()
    assert set(converted) == set(own)
    assert all(converted[k].shape == own[k].shape for k in own)


def test_a_bfl_named_vae_file_loads_into_the_tiny_config_first_stage(tmp_path):
    """configs/flux/tiny.yaml's first stage reads a bare BFL-named VAE file (ckpt_path), every
    tensor in place."""
    vae_config = OmegaConf.load(ROOT / "configs/flux/tiny.yaml").model.params.first_stage_config
    torch.manual_seed(0)
    source = instantiate_from_config(OmegaConf.to_container(vae_config))
    state = {k: torch.randn(v.shape) for k, v in source.state_dict().items()}
    path = tmp_path / "ae.safetensors"
    save_file(state, str(path))
    config = OmegaConf.to_container(vae_config)
    config["params"]["ckpt_path"] = str(path)
    loaded = instantiate_from_config(config).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
