"""`ldm.layout.family.model_family`: the one question every loader and script asks, of a model
config, of the model it builds and of that model's state dict - one answer for all three.

The expected families are what each tiny config is (its name and its conditioner: CompVis'
FrozenCLIPEmbedder is SD 1.x, sgm's two-tower GeneralConditioner is SDXL)."""

import logging
from pathlib import Path

import pytest
import torch

from ldm.layout import family
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny"


@pytest.mark.parametrize(
    "name, expected",
    [("ldm", family.SD1), ("sdxl", family.SDXL), ("dit", family.DIT), ("vae", family.VAE)],
)
def test_a_config_its_model_and_their_state_dict_have_one_family(name, expected):
    config = to_container(merge_configs([TINY / f"{name}.yaml"]))["model"]
    assert family.model_family(config) == expected
    params = {**(config.get("params") or {}), "ckpt_path": None}
    with torch.device("meta"):
        model = instantiate_from_config({**config, "params": params})
    assert family.model_family(model) == expected
    assert family.model_family(model.state_dict()) == expected
    assert family.model_family(list(model.state_dict())) == expected


def test_the_family_of_a_lora_config_is_its_base_and_says_nothing(caplog):
    """The family check builds the model on the meta device: without its adapters, which
    would log the run's "LoRA: adapters on ..." line once more."""
    config = to_container(merge_configs([TINY / "ldm.yaml", TINY / "lora.yaml"]))["model"]
    with caplog.at_level(logging.INFO):
        assert family.model_family(config) == family.SD1
    assert "adapters on" not in caplog.text


def test_a_config_that_cannot_be_built_has_no_family():
    """Unknown: the strict load that follows names the mismatch."""
    assert family.model_family({"target": "ldm.no_such_module.Model", "params": {}}) is None


# --- is_sdxl: the one SDXL test (issue 31) -------------------------------------------------
# Independent statements of SDXL: Stability-AI's own inference configs (sgm's sd_xl_base.yaml,
# CompVis' v1 / Stability's v2 configs), the released checkpoints' key lists (tests/reference)
# and diffusers' own single-file converter, which writes `addition_embed_type` for a config.
REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "reference"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ORIGINAL_CONFIGS = [
    (CONFIGS / "sdxl" / "sd_xl_base.yaml", True),
    (CONFIGS / "stable-diffusion" / "v1-inference.yaml", False),
    (CONFIGS / "stable-diffusion" / "v2-inference.yaml", False),
]


def _model_config(path: Path) -> dict:
    return to_container(merge_configs([path]))["model"]


@pytest.mark.parametrize("path, expected", ORIGINAL_CONFIGS, ids=lambda x: getattr(x, "stem", x))
def test_is_sdxl_of_the_original_configs(path, expected):
    assert family.is_sdxl(_model_config(path)) is expected


@pytest.mark.parametrize(
    "path",
    [
        CONFIGS / "sd3" / "tiny.yaml",
        CONFIGS / "flux" / "tiny.yaml",
        TINY / "dit.yaml",
        CONFIGS / "demo" / "shapes.yaml",
    ],
)
def test_a_conditioner_config_alone_is_not_sdxl(path):
    """SD 3 / Flux / a text DiT also have a `conditioner_config` (the old test in
    scripts/convert.py said SDXL for any of them)."""
    assert family.is_sdxl(_model_config(path)) is False


@pytest.mark.parametrize(
    "name, expected", [("sdxl_base_keys.json", True), ("sd_v1_keys.json", False)]
)
def test_is_sdxl_of_released_checkpoint_keys(name, expected):
    import json

    keys = json.loads((REFERENCE / name).read_text())["keys"]
    assert family.is_sdxl(list(keys)) is expected


@pytest.mark.parametrize("name", ["ldm", "ldm-our-names", "sdxl", "dit"])
def test_is_sdxl_says_the_same_of_a_config_its_model_and_its_keys(name):
    config = _model_config(TINY / f"{name.split('-')[0]}.yaml")
    if name == "ldm-our-names":  # an SD 1.x UNet under our `conditioner_config` name
        config["params"]["conditioner_config"] = config["params"].pop("cond_stage_config")
    with torch.device("meta"):
        model = instantiate_from_config(
            {**config, "params": {**config["params"], "ckpt_path": None}}
        )
    answers = {family.is_sdxl(config), family.is_sdxl(model), family.is_sdxl(model.state_dict())}
    assert answers == {name == "sdxl"}


@pytest.mark.parametrize("path, expected", ORIGINAL_CONFIGS, ids=lambda x: getattr(x, "stem", x))
def test_is_sdxl_of_the_diffusers_unet_config_diffusers_writes(path, expected):
    from diffusers.loaders.single_file_utils import create_unet_diffusers_config_from_ldm

    original = to_container(merge_configs([path]))
    unet = {
        "_class_name": "UNet2DConditionModel",
        **create_unet_diffusers_config_from_ldm(original, {}),
    }
    assert family.is_sdxl(unet) is expected


def test_sgm_sdxl_base_samples_at_1024_px():
    """sgm configs give no image_size; SDXL base was trained at 1024 px (Podell et al. 2023,
    sec. 2.3): 128 latent pixels. A reduced-width SDXL is no released layout: none given. (Was
    `adm_in_channels == 2816` in the config translation, now the UNet's presets.)"""
    backbone = _model_config(CONFIGS / "sdxl" / "sd_xl_base.yaml")["params"]["network_config"]
    with torch.device("meta"):
        assert instantiate_from_config(backbone).image_size == 1024 // 8
        backbone["params"]["model_channels"] = 64
        assert instantiate_from_config(backbone).image_size is None
        backbone["params"].update(model_channels=320, image_size=96)
        assert instantiate_from_config(backbone).image_size == 96  # a config's own wins
