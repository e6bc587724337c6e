"""DiT files load into LatentDiffusion: the released flat `.pt` and DiT train.py checkpoints."""

import argparse

import pytest
import torch

from ldm.checkpoint import load_weights
from ldm.diffusion import LatentDiffusion
from ldm.dit import DiT

DIT = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=2)


def latent_diffusion(**backbone) -> LatentDiffusion:
    return LatentDiffusion(
        backbone_config={"target": "ldm.dit.DiT", "params": {**DIT, "num_classes": 5, **backbone}},
        first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
        conditioner_config={"target": "ldm.conditioning.ClassLabels", "params": {"num_classes": 5}},
    )


def released_like(seed: int) -> dict:
    """A DiT state dict as facebookresearch/DiT saves it: its own names, no prefix."""
    torch.manual_seed(seed)
    model = DiT(**DIT, num_classes=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model.state_dict()


def assert_backbone_is(model: LatentDiffusion, state: dict) -> None:
    ours = model.backbone.state_dict()
    assert ours.keys() == state.keys()
    assert all(torch.equal(ours[k], state[k]) for k in state)


def test_the_released_flat_pt_loads_strictly(tmp_path):
    state = released_like(1)
    path = tmp_path / "DiT-tiny.pt"
    torch.save(state, path)
    model = latent_diffusion()
    load_weights(model, path)
    assert_backbone_is(model, state)
    # and through the constructor's ckpt_path, as a config names it
    params = {"num_classes": 5}
    assert_backbone_is(
        LatentDiffusion(
            backbone_config={"target": "ldm.dit.DiT", "params": {**DIT, **params}},
            first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
            conditioner_config={"target": "ldm.conditioning.ClassLabels", "params": params},
            ckpt_path=str(path),
        ),
        state,
    )


def test_a_dit_train_checkpoint_gives_its_ema_weights(tmp_path):
    """DiT's train.py saves {"model", "ema", "opt", "args"}; its sample.py takes "ema". The
    argparse Namespace unpickles without the unsafe flag (an inert attribute bag)."""
    raw, ema = released_like(1), released_like(2)
    path = tmp_path / "0400000.pt"
    args = argparse.Namespace(model="DiT-S/2", image_size=256)
    torch.save({"model": raw, "ema": ema, "opt": {"state": {}}, "args": args}, path)
    model = latent_diffusion()
    load_weights(model, path)
    assert_backbone_is(model, ema)
    load_weights(model, path, ema=False)
    assert_backbone_is(model, raw)


def test_a_dit_file_of_another_size_is_refused_by_name(tmp_path):
    path = tmp_path / "deeper.pt"
    torch.save(released_like(1), path)
    with pytest.raises(KeyError, match="missing keys, first: blocks.2"):
        load_weights(latent_diffusion(depth=3), path)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights(latent_diffusion(hidden_size=64), path)


def test_our_checkpoint_keeps_the_released_names_under_the_backbone_prefix(tmp_path):
    """A LatentDiffusion DiT saves `model.diffusion_model.` + the released names (and loads back)."""
    model = latent_diffusion()
    state = model.state_dict()
    names = {k.removeprefix("model.diffusion_model.") for k in state if k.startswith("model.")}
    assert names == set(DiT(**DIT, num_classes=5).state_dict())
    path = tmp_path / "ours.ckpt"
    torch.save({"state_dict": state}, path)
    other = latent_diffusion()
    load_weights(other, path)
    assert_backbone_is(other, model.backbone.state_dict())
