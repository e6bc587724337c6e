"""txt2img, img2img and convert on a checkpoint saved by a real (2-step) training run."""

from pathlib import Path

import convert
import img2img
import pytest
import torch
import txt2img
from PIL import Image

from ldm import checkpoint
from ldm.layout.ema import EMA_SCALARS
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

pytestmark = pytest.mark.slow


def generate(script, tmp_path: Path, run: Path, name: str, *extra: str) -> Path:
    outdir = tmp_path / name
    script.main(
        [
            "--ckpt",
            str(run / "checkpoints" / "last.ckpt"),
            "--outdir",
            str(outdir),
            "--steps",
            "3",
            "--prompt",
            "a red circle",
            "--n_samples",
            "2",
            "--seed",
            "5",
            *extra,
        ]
    )
    return outdir


def test_txt2img_writes_deterministic_pngs_with_parameters(tmp_path, trained_run):
    first = generate(
        txt2img, tmp_path, trained_run, "a", "--negative-prompt", "blurry", "--H", "48", "--W", "32"
    )
    again = generate(
        txt2img, tmp_path, trained_run, "b", "--negative-prompt", "blurry", "--H", "48", "--W", "32"
    )
    samples = sorted((first / "samples").glob("*.png"))
    assert [p.name for p in samples] == ["00000.png", "00001.png"]
    assert len(list(first.glob("grid-*.png"))) == 1
    for path in samples:
        image = Image.open(path)
        assert image.size == (32, 48) and image.mode == "RGB"
        assert path.read_bytes() == (again / "samples" / path.name).read_bytes()
    text = Image.open(samples[1]).text["parameters"]
    lines = text.splitlines()
    assert lines[0] == "a red circle" and lines[1] == "Negative prompt: blurry"
    assert "Steps: 3, Sampler: DDIM, CFG scale: 7.5, Seed: 6, Size: 32x48, Model hash: " in lines[2]
    assert checkpoint.file_hash(trained_run / "checkpoints" / "last.ckpt") in lines[2]


def test_txt2img_seed_and_sampler_change_the_image(tmp_path, trained_run):
    base = generate(txt2img, tmp_path, trained_run, "a", "--skip_grid")
    other_seed = generate(txt2img, tmp_path, trained_run, "b", "--skip_grid", "--seed", "9")
    euler = generate(txt2img, tmp_path, trained_run, "c", "--skip_grid", "--sampler", "euler_a")
    same = (base / "samples" / "00000.png").read_bytes()
    assert same != (other_seed / "samples" / "00000.png").read_bytes()
    assert same != (euler / "samples" / "00000.png").read_bytes()
    assert not list(base.glob("grid-*.png"))


def test_txt2img_clear_errors(tmp_path, trained_run):
    with pytest.raises(SystemExit, match="multiples of 4 for this model"):
        generate(txt2img, tmp_path, trained_run, "a", "--H", "30")
    with pytest.raises(SystemExit, match="nope.ckpt: no such file"):
        txt2img.main(["--ckpt", str(tmp_path / "nope.ckpt"), "--config", "x.yaml"])


def test_img2img_keeps_the_size_of_the_init_image(tmp_path, trained_run, shapes_dir):
    init = sorted((shapes_dir / "images").glob("*.png"))[0]
    out = generate(
        img2img, tmp_path, trained_run, "i2i", "--init-img", str(init), "--strength", "0.5"
    )
    image = Image.open(out / "samples" / "00000.png")
    assert image.size == Image.open(init).size
    assert "Denoising strength: 0.5" in image.text["parameters"]


def tiny_model(run: Path):
    (config,) = sorted((run / "configs").glob("*-project.yaml"))
    return instantiate_from_config(to_container(merge_configs([config]))["model"])


def test_convert_to_safetensors_loads_back_strictly(tmp_path, trained_run):
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    out = tmp_path / "model.safetensors"
    convert.main([str(ckpt), str(out), "--ema", "--half"])
    state = checkpoint.load_file_state(out)
    assert not any(k.startswith("model_ema.") for k in state)
    assert state["model.diffusion_model.out.2.weight"].dtype == torch.float16
    source = checkpoint.state_dict_of(checkpoint.load_file_state(ckpt))
    ema = source["model_ema.diffusion_modelout2weight"]
    torch.testing.assert_close(
        state["model.diffusion_model.out.2.weight"].float(), ema, atol=1e-3, rtol=1e-3
    )
    checkpoint.load_weights(tiny_model(trained_run), out)  # strict

    pruned = tmp_path / "pruned.ckpt"
    convert.main([str(ckpt), str(pruned), "--prune"])
    contents = checkpoint.load_file_state(pruned)
    assert "optimizer_states" not in contents
    assert set(contents["state_dict"]) == set(source) - {
        k for k in source if k.startswith("model_ema.") and k not in EMA_SCALARS
    }


def with_random_unet(trained_run: Path, out: Path, seed: int = 0) -> Path:
    """The trained checkpoint with every UNet weight drawn at random, the zero-initialised output
    layers (`out.2`, resblocks' `out_layers.3`, attention `proj_out`) included.

    After 2 training steps those output layers are still ~0, so the UNet barely moves the image
    and a pipeline with a wrong or missing UNet would still match ours. Random weights at the
    scale of a trained network (norms ~1, weights ~1/sqrt(fan_in)) make the image the UNet's.
    The EMA shadows are left as they were: both sides must use the model weights."""
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    contents = checkpoint.load_file_state(ckpt)
    state = checkpoint.state_dict_of(contents)
    unet = tiny_model(trained_run).model.diffusion_model
    generator = torch.Generator().manual_seed(seed)
    for module_name, module in unet.named_modules():
        for name, param in module.named_parameters(recurse=False):
            noise = torch.randn(param.shape, generator=generator)
            if isinstance(module, torch.nn.GroupNorm | torch.nn.LayerNorm):
                value = (1.0 if name == "weight" else 0.0) + 0.2 * noise
            elif param.ndim == 1:  # biases
                value = 0.2 * noise
            else:
                value = noise / param[0].numel() ** 0.5
            key = f"model.diffusion_model.{module_name}.{name}".replace("..", ".")
            assert key in state, key
            state[key] = value
    torch.save({**contents, "state_dict": state}, out)
    return out


def test_diffusers_pipeline_matches_our_txt2img(tmp_path, trained_run):
    diffusers = pytest.importorskip("diffusers")
    (config,) = sorted((trained_run / "configs").glob("*-project.yaml"))
    ckpt = with_random_unet(trained_run, tmp_path / "random_unet.ckpt")
    folder = tmp_path / "pipeline"
    convert.main([str(ckpt), "--config", str(config), "--to-diffusers", str(folder)])
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)

    model = tiny_model(trained_run).eval()
    checkpoint.load_weights(model, ckpt, ema=False)
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    ours = model.sample(
        ["a blue square"], height=32, width=32, steps=5, scale=4.0, noise=noise.clone()
    )
    # The test can see the UNet: without it (zeroed) our image moves far beyond the tolerance
    # below (by ~0.3 of the range at some pixel).
    with torch.no_grad():
        for param in model.model.diffusion_model.parameters():
            param.zero_()
    no_unet = model.sample(
        ["a blue square"], height=32, width=32, steps=5, scale=4.0, noise=noise.clone()
    )
    assert ((ours - no_unet) / 2).abs().max() > 50 * 2e-3
    theirs = pipe(
        "a blue square",
        height=32,
        width=32,
        num_inference_steps=5,
        guidance_scale=4.0,
        latents=noise.clone(),
        output_type="pt",
    ).images
    torch.testing.assert_close((ours + 1) / 2, theirs.float(), atol=2e-3, rtol=0)
