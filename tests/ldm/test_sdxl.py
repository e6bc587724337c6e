"""SDXL: the original sgm config builds the original state dict; conditioning and its dropout."""

import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from sdxl_helpers import ADM_CHANNELS, SGM_CONFIG, TEXT_WIDTH, tiny_sdxl

from ldm.checkpoint import load_weights, save_safetensors
from ldm.conditioning_xl import GeneralConditioner
from ldm.unet import UNetModel
from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = json.loads((ROOT / "tests" / "reference" / "sdxl_base_keys.json").read_text())


@pytest.fixture(scope="module")
def model():
    return tiny_sdxl(seed=0)


@pytest.mark.slow  # ~5 s: builds the 3.5 B-parameter model on the meta device
def test_the_sgm_config_builds_the_sdxl_base_state_dict(caplog):
    config = OmegaConf.to_container(OmegaConf.load(SGM_CONFIG))
    with caplog.at_level(logging.WARNING), torch.device("meta"):  # full size, no memory
        model = instantiate_from_config(config["model"])
    assert isinstance(model.backbone, UNetModel)
    assert isinstance(model.conditioner, GeneralConditioner)
    ours = {name: list(t.shape) for name, t in model.state_dict().items()}
    expected = REFERENCE["keys"]
    optional = set(REFERENCE["optional_keys"])
    assert sorted(set(expected) - set(ours)) <= sorted(optional)  # position_ids
    assert sorted(set(ours) - set(expected)) == []  # no schedule buffers, no sigmas
    assert ours == {k: v for k, v in expected.items() if k in ours}
    # what has no meaning here is said once, by name
    assert [r.message for r in caplog.records if "spatial_transformer_attn_type" in r.message]
    assert model.scale_factor == 0.13025 and model.parameterization == "eps"
    assert model.num_timesteps == 1000 and model.first_stage_fp32


def test_an_sgm_file_with_its_optional_constants_loads_strictly(model, tmp_path):
    # the DDPM schedule of sgm's LegacyDDPMDiscretization: computed, not stored
    torch.testing.assert_close(model.betas[[0, -1]].float(), torch.tensor([0.00085, 0.012]))
    state = model.state_dict()
    state["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.arange(
        77
    )[None]
    state["denoiser.sigmas"] = torch.rand(1000)
    save_safetensors(state, tmp_path / "sdxl.safetensors")
    other = tiny_sdxl(seed=1)
    load_weights(other, tmp_path / "sdxl.safetensors")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], value, rtol=0, atol=0)


def test_conditioning_fields_and_size_features(model):
    batch = {
        "caption": ["a red circle", "a blue square"],
        "original_size_as_tuple": torch.tensor([[512, 768], [1024, 1024]]),
        "crop_coords_top_left": torch.tensor([[0, 0], [16, 32]]),
        "target_size_as_tuple": torch.tensor([[32, 32], [32, 32]]),
    }
    cond = model.conditioning(batch)
    assert cond["crossattn"].shape == (2, 77, 2 * TEXT_WIDTH)
    assert cond["vector"].shape == (2, ADM_CHANNELS)
    # each size number -> [cos | sin] of 8 channels (sgm's timestep embedding), in key order
    size = cond["vector"][:, TEXT_WIDTH:].reshape(2, 6, 8)
    numbers = torch.tensor([[512, 768, 0, 0, 32, 32], [1024, 1024, 16, 32, 32, 32]]).float()
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(4) / 4)
    args = numbers[..., None] * freqs
    torch.testing.assert_close(size, torch.cat([args.cos(), args.sin()], dim=-1))
    # the defaults: original = target = the image size, crop (0, 0) (diffusers' pipeline)
    alone = model.conditioning({"caption": batch["caption"], "image_size": (32, 32)})
    expected = torch.cat([numbers.new_tensor([32, 32, 0, 0, 32, 32])[None].expand(2, 6)], 0)
    args = expected[..., None] * freqs
    torch.testing.assert_close(
        alone["vector"][:, TEXT_WIDTH:].reshape(2, 6, 8), torch.cat([args.cos(), args.sin()], -1)
    )
    # the two towers' features side by side, CLIP-L first
    clip_only = model.conditioner.embedders[0](batch["caption"])
    torch.testing.assert_close(cond["crossattn"][..., :TEXT_WIDTH], clip_only)


def test_caption_dropout_drops_both_text_encoders_together():
    model = tiny_sdxl(extra=["model.params.conditioner_config.params.ucg_rate=0.5"])
    captions = [f"caption {i}" for i in range(64)]
    batch = {"caption": captions, "image_size": (32, 32)}
    full = model.conditioning(batch)
    generator = torch.Generator().manual_seed(0)
    cond = model.conditioning(batch, generator, drop=True)
    clip_zero = cond["crossattn"][..., :TEXT_WIDTH].abs().sum(dim=(1, 2)) == 0
    bigg_zero = cond["crossattn"][..., TEXT_WIDTH:].abs().sum(dim=(1, 2)) == 0
    pooled_zero = cond["vector"][:, :TEXT_WIDTH].abs().sum(dim=1) == 0
    assert 10 < clip_zero.sum() < 54  # about half
    assert torch.equal(clip_zero, bigg_zero) and torch.equal(clip_zero, pooled_zero)
    kept = ~clip_zero
    torch.testing.assert_close(cond["crossattn"][kept], full["crossattn"][kept])
    # the size features are never dropped
    torch.testing.assert_close(cond["vector"][:, TEXT_WIDTH:], full["vector"][:, TEXT_WIDTH:])


def test_unconditional_side_is_zeros_or_the_negative_prompt(model):
    batch = {"caption": ["a red circle"], "image_size": (32, 32)}
    cond = model.conditioning(batch)
    uncond = model.unconditional(batch)  # force_zeros_for_empty_prompt, as diffusers' SDXL
    assert uncond["crossattn"].abs().sum() == 0
    assert uncond["vector"][:, :TEXT_WIDTH].abs().sum() == 0
    torch.testing.assert_close(uncond["vector"][:, TEXT_WIDTH:], cond["vector"][:, TEXT_WIDTH:])
    # per sample: a negative prompt is encoded, an empty one (txt2img's default) is zeros
    batch = {"caption": ["a red circle", "a cat"], "image_size": (32, 32)}
    negative = model.unconditional(batch, ["blurry", ""])
    expected = model.conditioning({**batch, "caption": ["blurry", "x"]})
    torch.testing.assert_close(negative["crossattn"][0], expected["crossattn"][0])
    torch.testing.assert_close(negative["vector"][0], expected["vector"][0])
    assert negative["crossattn"][1].abs().sum() == 0
    assert negative["vector"][1, :TEXT_WIDTH].abs().sum() == 0
