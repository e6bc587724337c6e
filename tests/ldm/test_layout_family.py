"""`ldm.layout.family.model_family`: the one question every loader and script asks, of a model
config, of the model it builds and of that model's state dict - one answer for all three.

The expected families are what each tiny config is (its name and its conditioner: CompVis'
FrozenCLIPEmbedder is SD 1.x, sgm's two-tower GeneralConditioner is SDXL)."""

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


def test_a_config_that_cannot_be_built_has_no_family():
    """Unknown: the strict load that follows names the mismatch."""
    assert family.model_family({"target": "ldm.no_such_module.Model", "params": {}}) is None
