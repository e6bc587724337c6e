"""SDXL exported as a diffusers `StableDiffusionXLPipeline` folder (`convert.py --to-diffusers`):
diffusers' own pipeline, loaded from the folder, draws our txt2img image, and the folder read
back by ldm.layout.diffusers gives the original tensors bit for bit."""

import json
import math

import convert
import numpy as np
import pytest
import torch
import txt2img
from omegaconf import OmegaConf
from PIL import Image
from sdxl_helpers import tiny_sdxl, tiny_sdxl_config, trained_scale_weights

from ldm import checkpoint
from ldm.layout import diffusers as diffusers_layout
from ldm.util import instantiate_from_config

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow
LOGIT_SCALE = "conditioner.embedders.1.model.logit_scale"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config file, original .safetensors, its state dict, the folder convert.py wrote)."""
    root = tmp_path_factory.mktemp("sdxl_export")
    # Every weight random at a trained network's scale (norms ~1): tiny_sdxl's own draw (norm
    # weights ~0.1) leaves an image that barely hears the text (a "" negative prompt instead of
    # zeros moved it by 8e-4, within the tolerance); at this scale by 0.67, a swapped size 0.08.
    model = tiny_sdxl(seed=4)
    trained_scale_weights(model, seed=4)
    state = model.state_dict()
    config, ckpt, folder = root / "sdxl.yaml", root / "sdxl.safetensors", root / "pipeline"
    OmegaConf.save(tiny_sdxl_config(), config)
    checkpoint.save_safetensors(state, ckpt)
    convert.main([str(ckpt), "--config", str(config), "--to-diffusers", str(folder)])
    return config, ckpt, state, folder


def test_round_trip_through_the_export_is_bit_exact(exported):
    """original -> our export (diffusers' converters) -> ldm.layout.diffusers -> original: every
    key but OpenCLIP's `logit_scale` (diffusers stores none; CLIP's contrastive loss is its only
    user) comes back with the same bits; the model loads the folder strictly."""
    config, _, state, folder = exported
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["scheduler"] == ["diffusers", "EulerDiscreteScheduler"]  # as SDXL base 1.0

    back, info = diffusers_layout.original_state(folder)
    assert (info.family, info.parameterization, info.scale_factor) == ("sdxl", "eps", 0.13025)
    assert set(back) == set(state) - {LOGIT_SCALE}
    for key, value in back.items():
        assert value.dtype == state[key].dtype and torch.equal(value, state[key]), key

    model = instantiate_from_config(OmegaConf.to_container(OmegaConf.load(config))["model"])
    checkpoint.load_weights(model, folder)  # strict
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in back)
    assert loaded[LOGIT_SCALE].item() == pytest.approx(math.log(1 / 0.07))


def test_diffusers_sdxl_pipeline_draws_our_txt2img_image(tmp_path, exported):
    """Same seed and DDIM steps, guidance with a zero unconditional side, size conditioning
    (original = target = H x W, crop 0) from a non-square size in both."""
    config, ckpt, _, folder = exported
    seed, prompt, height, width = 3, "a red circle", 16, 24
    txt2img.main(
        ["--ckpt", str(ckpt), "--config", str(config), "--prompt", prompt, "--steps", "5"]
        + ["--scale", "4", "--seed", str(seed), "--H", str(height), "--W", str(width)]
        + ["--outdir", str(tmp_path), "--skip_grid", "--device", "cpu", "--sampler", "ddim"]
    )
    ours = np.asarray(Image.open(tmp_path / "samples" / "00000.png"), dtype=np.float32) / 255

    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    # The folder's Euler config carries DDIM's settings (no clipping, no final alpha of one) as
    # SDXL base 1.0's does: diffusers' usual switch to DDIM samples as ours.
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    # txt2img's starting noise for this seed (lun.generation.starting_noise); the tiny VAE
    # halves each side.
    shape = (1, 4, height // 2, width // 2)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    theirs = pipe(
        prompt,
        height=height,
        width=width,
        num_inference_steps=5,
        guidance_scale=4.0,
        latents=noise,
        output_type="np",
    ).images[0]
    # The SD export test's tolerance (2e-3 of the range), plus the PNG's rounding to 1/255.
    np.testing.assert_allclose(ours, theirs, atol=2e-3 + 0.5 / 255, rtol=0)
    assert ours.std() > 0.05  # an image, not a flat field


def test_a_conditioner_the_pipeline_cannot_compute_is_one_line_and_exit_2(
    tmp_path, exported, capsys
):
    """CLIP at another layer than the pipeline's `hidden_states[-2]`: refused, no folder."""
    _, ckpt, _, _ = exported
    config = tiny_sdxl_config()
    config["model"]["params"]["conditioner_config"]["params"]["emb_models"][0]["params"][
        "layer_idx"
    ] = 0
    OmegaConf.save(config, tmp_path / "layer0.yaml")
    out = tmp_path / "pipeline"
    with pytest.raises(SystemExit) as stop:
        convert.main(
            [str(ckpt), "--config", str(tmp_path / "layer0.yaml"), "--to-diffusers", str(out)]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "penultimate layer" in err.strip().splitlines()[-1] and "layer_idx: 1" in err
    assert not out.exists()
