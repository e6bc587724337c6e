"""Every LightningModule lun trains satisfies the contract (lun.contract.TrainableModule), and
the parts of lun that use a module use nothing else of it."""

import ast
from pathlib import Path

import pytest
import torch

from ldm.diffusion import LatentDiffusion
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.contract import TrainableModule

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = {"ema_module", "log_images", "latent_shape", "default_image_size"}
# What every LightningModule has (Lightning's own API), which lun may also use.
LIGHTNING_API = {"device", "training", "train", "eval", "log", "trainer", "_trainer", "global_step"}
# Whether the module steps its own optimizers (the VAE trainer): Lightning's flag.
LIGHTNING_API |= {"automatic_optimization"}
MODULE_API = {"named_parameters"}  # torch.nn.Module: where a weight sits in the checkpoint


def test_latent_diffusion_satisfies_the_contract(tiny_config):
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    assert isinstance(model, LatentDiffusion) and isinstance(model, TrainableModule)
    assert model.ema_module is model.model
    assert model.latent_shape(32, 16) == (4, 16, 8)  # 2-level VAE: 2x smaller, 4 channels
    assert model.default_image_size == 32  # image_size 16 (latent) x 2
    images = model.eval().log_images({"caption": ["a", "b"]}, N=2, steps=1)
    assert images["samples"].shape == (2, 3, 32, 32)  # at the default size


def test_lun_uses_only_the_contract_of_pl_module():
    """Attribute reads of `pl_module` / `model` parameters in lun's callbacks stay inside the
    contract and Lightning's API."""
    used = set()
    for path in (ROOT / "lun" / "callbacks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "pl_module"
            ):
                used.add(node.attr)
    outside = used - CONTRACT - LIGHTNING_API - MODULE_API
    assert outside == set(), sorted(outside)
    assert {"ema_module", "log_images"} <= used


def test_latent_shape_names_the_size_multiple(tiny_config):
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    with pytest.raises(ValueError, match="multiples of 4"):
        model.latent_shape(30, 32)
    assert torch.Size(model.latent_shape(64, 64)) == (4, 32, 32)
