"""UNet presets and the original-config adapter, against the released files' key lists and
diffusers' own reading of the original configs."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm.unet import UNet, UNetModel, sd15, sdxl
from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"  # key -> shape lists of the released checkpoints
PREFIX = "model.diffusion_model."
SHARED_CONFIGS = Path("/work/shared/reference/configs")  # the original CompVis / sgm files


def released_unet(keys_name: str) -> dict:
    reference = json.loads((REFERENCE / f"{keys_name}.json").read_text())["keys"]
    return {k[len(PREFIX) :]: v for k, v in reference.items() if k.startswith(PREFIX)}


def shapes(module: torch.nn.Module) -> dict:
    return {name: list(t.shape) for name, t in module.state_dict().items()}


@pytest.mark.parametrize(
    "preset, params, keys_name",
    [
        ("sd15", {}, "sd_v1_keys"),
        ("sd2", {}, "sd_v2_base_keys"),
        ("sd2", {"image_size": 96}, "sd_v2_v_keys"),
        ("sdxl", {"use_checkpoint": True}, "sdxl_base_keys"),
    ],
    ids=["sd15", "sd2-base", "sd2-v", "sdxl"],
)
def test_presets_build_the_released_state_dict(preset, params, keys_name):
    with torch.device("meta"):  # full size, no memory; a preset is a config target
        unet = instantiate_from_config({"target": f"ldm.unet.{preset}", "params": params})
    assert isinstance(unet, UNet)
    assert shapes(unet) == released_unet(keys_name)


def test_preset_geometry_and_needs():
    with torch.device("meta"):
        sd, xl = sd15(), sdxl()
    # SD 1.x samples 512 px = 64 latent pixels, SDXL 1024 px = 128 (Podell et al. 2023, sec. 2.3).
    assert (sd.image_size, sd.size_multiple, sd.vector_dim) == (64, 8, None)
    # SDXL's vector: pooled bigG text 1280 + 6 size / crop numbers x 256 Fourier channels.
    assert (xl.image_size, xl.size_multiple, xl.vector_dim) == (128, 4, 1280 + 6 * 256)


def unet_configs() -> list[tuple[str, dict]]:
    """Every distinct UNet `params` in configs/ and the reference (original) configs."""
    found = {}
    paths = sorted((ROOT / "configs").glob("**/*.yaml"))
    paths += sorted(SHARED_CONFIGS.glob("*.yaml"))  # where the session's copies exist
    for path in paths:
        model = OmegaConf.to_container(OmegaConf.load(path)).get("model") or {}
        params = model.get("params") or {}
        unet = params.get("unet_config") or params.get("network_config") or {}
        if unet.get("target", "").endswith("UNetModel"):
            found.setdefault(
                json.dumps(unet, sort_keys=True), (f"{path.parent.name}/{path.name}", unet)
            )
    return list(found.values())


CONFIGS = unet_configs()


@pytest.mark.parametrize("name, config", CONFIGS, ids=[name for name, _ in CONFIGS])
def test_original_configs_build_what_diffusers_reads_from_them(name, config):
    """diffusers' single-file loader reads the original `unet_config` itself (channels, heads,
    use_linear_in_transformer, depths, the class / vector embedding); our state dict, renamed by
    its converter, must be exactly the diffusers UNet it builds from that config."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    with torch.device("meta"):
        ours = instantiate_from_config(config)
        assert isinstance(ours, UNetModel)
        checkpoint = {PREFIX + k: v for k, v in ours.state_dict().items()}
        original = {
            "model": {
                "params": {
                    "unet_config": config,
                    "network_config": config,
                    "first_stage_config": {"params": {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}},
                }
            }
        }
        diffusers_config = create_unet_diffusers_config_from_ldm(original, checkpoint)
        theirs = UNet2DConditionModel(**diffusers_config)
    converted = convert_ldm_unet_checkpoint(checkpoint, diffusers_config)
    assert shapes(theirs) == {k: list(v.shape) for k, v in converted.items()}


def test_the_model_takes_a_layout_and_four_options():
    # Issue 31.6: at most 12 constructor arguments; the original spelling is UNetModel's.
    assert len(inspect.signature(UNet).parameters) <= 12
