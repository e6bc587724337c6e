"""txt2img / img2img as a user runs them, on tiny random models: what each flag really does.

Each family's sampling is checked against diffusers' numbers (the timesteps its pipeline feeds
the network), not against our own code: SD 1.x DDIM "leading" steps, v-prediction, SD3's
flow-matching Euler with the model's shift, Flux's dynamic shift with its distilled guidance
fed instead of CFG. The network is watched by wrapping `LatentDiffusion.apply_model`.
"""

import argparse
import hashlib

import img2img
import numpy as np
import pytest
import torch
import txt2img
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from omegaconf import OmegaConf
from PIL import Image
from png_helpers import parse_a1111_parameters
from sd3_helpers import t5_tokenizer_folder

from ldm.diffusion import LatentDiffusion
from ldm.util import instantiate_from_config
from lun import cli
from lun.config import merge_configs, to_container
from lun.generation import open_init_image

DIT_CLASSES = [  # the shapes DiT (18 classes, pixel space) at toy width
    "model.params.backbone_config.params.hidden_size=32",
    "model.params.backbone_config.params.depth=1",
    "model.params.backbone_config.params.num_heads=2",
    "lightning.trainer.max_steps=10",
]


def _save_model(folder, name, config, overrides=()):
    cfg = merge_configs([config], list(overrides))
    OmegaConf.save(cfg, folder / f"{name}.yaml")
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(cfg)["model"])
    with torch.no_grad():  # off the init (a zero output layer would draw the same for any seed)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": model.state_dict()}, folder / f"{name}.ckpt")
    return ["--config", str(folder / f"{name}.yaml"), "--ckpt", str(folder / f"{name}.ckpt")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    tokenizer = t5_tokenizer_folder(folder / "t5")
    t5 = f"model.params.conditioner_config.params.t5xxl.tokenizer={tokenizer}"
    return {
        "sd1": _save_model(folder, "sd1", "configs/tiny/ldm.yaml"),
        "v": _save_model(folder, "v", "configs/tiny/ldm.yaml", ["model.params.parameterization=v"]),
        "sd3": _save_model(
            folder, "sd3", "configs/sd3/tiny.yaml", ["model.params.schedule.shift=3.0"]
        ),
        "flux": _save_model(folder, "flux", "configs/flux/tiny.yaml", [t5]),
        "class": _save_model(folder, "class", "configs/dit/shapes-dit.yaml", DIT_CLASSES),
    }


@pytest.fixture
def calls(monkeypatch):
    """Every network call of the run: (batch, t as a list, the cond's "guidance" or None)."""
    seen = []
    original = LatentDiffusion.apply_model

    def watched(self, x_t, t, cond):
        guidance = cond.get("guidance") if isinstance(cond, dict) else None
        seen.append((x_t.shape[0], t.tolist(), None if guidance is None else guidance.tolist()))
        return original(self, x_t, t, cond)

    monkeypatch.setattr(LatentDiffusion, "apply_model", watched)
    return seen


def run(script, model, out, *flags):
    script.main([*model, "--outdir", str(out), "--skip-grid", *flags])
    return sorted((out / "samples").glob("*.png"))


def parameters(path):
    return parse_a1111_parameters(Image.open(path).text["parameters"])


def one_line_exit(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


# --- flags refused before anything loads ---------------------------------------------------------
@pytest.mark.parametrize("value", ["-1", str(2**32), str(2**64), "1.5"])
def test_a_seed_out_of_range_is_one_argparse_line(capsys, value):
    line = one_line_exit(capsys, txt2img.main, ["--ckpt", "x.ckpt", "--seed", value])
    assert "error: argument --seed:" in line and value in line


def test_the_seed_type_takes_the_32_bit_range():
    assert cli.seed("0") == 0 and cli.seed(str(2**32 - 1)) == 2**32 - 1
    with pytest.raises(argparse.ArgumentTypeError):
        cli.seed(str(2**32))


@pytest.mark.parametrize("strength", ["-0.1", "1.01", "nan"])
def test_img2img_strength_out_of_range_is_one_line(capsys, strength):
    argv = ["--ckpt", "x.ckpt", "--init-img", "x.png", "--strength", strength]
    assert "--strength must be in [0, 1]" in one_line_exit(capsys, img2img.main, argv)


def test_a_dtype_without_autocast_is_one_line(capsys):
    line = one_line_exit(capsys, txt2img.main, ["--ckpt", "x.ckpt", "--dtype", "fp16"])
    assert "--dtype fp16 applies with --precision autocast" in line


def test_an_unknown_sampler_lists_the_valid_ones(capsys):
    line = one_line_exit(capsys, txt2img.main, ["--ckpt", "x.ckpt", "--sampler", "lms"])
    assert "--sampler: invalid choice: 'lms'" in line and "'dpmpp_2m'" in line


# --- DDPM families (SD 1.x eps, SD 2.x v) ---------------------------------------------------------
def test_same_seed_same_png_another_seed_another(models, tmp_path):
    flags = ["--steps", "2", "--sampler", "euler_a", "--W", "16", "--H", "16"]
    first = run(txt2img, models["sd1"], tmp_path / "a", *flags, "--seed", "7")[0]
    again = run(txt2img, models["sd1"], tmp_path / "b", *flags, "--seed", "7")[0]
    other = run(txt2img, models["sd1"], tmp_path / "c", *flags, "--seed", "8")[0]
    digest = [hashlib.sha256(Image.open(p).tobytes()).hexdigest() for p in (first, again, other)]
    assert digest[0] == digest[1] != digest[2]


def test_ddim_runs_diffusers_steps_and_scale_1_runs_no_unconditional_pass(models, tmp_path, calls):
    # SD's DDIMScheduler (steps_offset 1, "leading"): the timesteps fed, one call per step.
    run(
        txt2img, models["v"], tmp_path / "a", "--steps", "3", "--scale", "1", "--W", "8", "--H", "8"
    )
    reference = DDIMScheduler(steps_offset=1, beta_schedule="scaled_linear")
    reference.set_timesteps(3)
    assert [t[0] for _, t, _ in calls] == reference.timesteps.tolist()
    assert [batch for batch, _, _ in calls] == [1, 1, 1]
    calls.clear()
    run(
        txt2img, models["v"], tmp_path / "b", "--steps", "3", "--scale", "3", "--W", "8", "--H", "8"
    )
    assert [batch for batch, _, _ in calls] == [2, 2, 2]  # conditional and unconditional at once


@pytest.mark.parametrize(("strength", "runs"), [(0.0, 0), (0.5, 2), (0.7, 2), (1.0, 4)])
def test_img2img_runs_the_last_int_steps_times_strength_steps(
    models, tmp_path, calls, strength, runs
):
    Image.new("RGB", (12, 12), (200, 30, 30)).save(tmp_path / "init.png")
    flags = ["--init-img", str(tmp_path / "init.png"), "--steps", "4", "--scale", "1"]
    [png] = run(img2img, models["sd1"], tmp_path / "out", *flags, "--strength", str(strength))
    # diffusers' img2img rule (get_timesteps): the last int(steps * strength) of the schedule.
    reference = DDIMScheduler(steps_offset=1, beta_schedule="scaled_linear")
    reference.set_timesteps(4)
    expected = reference.timesteps.tolist()[4 - runs :] if runs else []
    assert [t[0] for _, t, _ in calls] == expected
    assert Image.open(png).size == (12, 12)  # the init image's size, a multiple of 4
    assert parameters(png)["Denoising strength"] == str(strength)


def test_numbering_and_seeds_of_samples_and_iterations(models, tmp_path):
    flags = ["--steps", "1", "--W", "8", "--H", "8", "--seed", "5"]
    first = run(txt2img, models["sd1"], tmp_path, *flags, "--n-samples", "2", "--n-iter", "2")
    assert [p.name for p in first] == [f"{i:05d}.png" for i in range(4)]
    assert [parameters(p)["Seed"] for p in first] == ["5", "6", "7", "8"]
    both = run(txt2img, models["sd1"], tmp_path, *flags)  # a second run adds, never replaces
    assert [p.name for p in both][-1] == "00004.png"
    # The seed a PNG records makes that image again on its own.
    alone = run(txt2img, models["sd1"], tmp_path / "alone", *flags[:-1], "8")[0]
    assert np.array_equal(np.asarray(Image.open(alone)), np.asarray(Image.open(first[3])))


def test_prompts_file_skips_blank_lines(models, tmp_path):
    (tmp_path / "prompts.txt").write_text("\n  \na red cat\n\nblue dog\n")
    flags = ["--from-file", str(tmp_path / "prompts.txt"), "--steps", "1", "--W", "8", "--H", "8"]
    written = run(txt2img, models["sd1"], tmp_path / "out", *flags)
    assert [parameters(p)["Prompt"] for p in written] == ["a red cat", "blue dog"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--H", "30"],
            "error: --H 30: height and width must be multiples of 4 for this model (e.g. 28 or 32)",
        ),
        (
            ["--W", "2"],
            "error: --W 2: height and width must be multiples of 4 for this model (e.g. 4)",
        ),
        (["--device", "nosuch"], "error: --device nosuch: not a device name"),
        (["--guidance", "2"], "error: --guidance: this model takes no distilled guidance"),
        (["--negative-prompt", "x", "--scale", "1"], "error: --negative-prompt is used by"),
        (["--steps", "1001"], "error: --steps 1001: this model has 1000 training steps"),
    ],
)
def test_bad_values_are_one_line_naming_the_flag(models, tmp_path, capsys, flags, expected):
    line = one_line_exit(capsys, txt2img.main, [*models["sd1"], "--outdir", str(tmp_path), *flags])
    assert line.startswith(expected)


def test_autocast_on_a_cpu_runs(models, tmp_path):
    flags = ["--steps", "1", "--W", "8", "--H", "8", "--precision", "autocast", "--device", "cpu"]
    assert len(run(txt2img, models["sd1"], tmp_path, *flags, "--dtype", "bf16")) == 1


# --- flow families: SD3 (fixed shift), Flux (dynamic shift, distilled guidance) ---------------------
def test_sd3_runs_flow_euler_with_the_models_shift_and_says_euler(models, tmp_path, calls):
    [png] = run(txt2img, models["sd3"], tmp_path, "--steps", "3", "--scale", "2")
    shift = OmegaConf.load(models["sd3"][1]).model.params.schedule.shift
    assert shift == 3.0
    reference = FlowMatchEulerDiscreteScheduler(shift=shift)
    reference.set_timesteps(3)
    np.testing.assert_allclose([t[0] for _, t, _ in calls], reference.timesteps.numpy(), rtol=1e-5)
    assert [batch for batch, _, _ in calls] == [2, 2, 2]
    found = parameters(png)
    assert (found["Sampler"], found["CFG scale"]) == ("Euler", "2.0")  # was "DDIM"


def test_flux_feeds_its_guidance_instead_of_cfg(models, tmp_path, calls):
    # diffusers' FluxPipeline: sigmas linspace(1, 1/steps) shifted by exp(mu) of the image tokens,
    # guidance_scale fed to the transformer, no unconditional pass (true_cfg_scale 1).
    [plain] = run(txt2img, models["flux"], tmp_path / "a", "--steps", "3")
    latent = 32 // 2  # the tiny VAE halves; Flux packs 2 x 2 patches
    mu = calculate_shift((latent // 2) ** 2, 256, 4096, 0.5, 1.15)
    reference = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    reference.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3), mu=mu)
    np.testing.assert_allclose([t[0] for _, t, _ in calls], reference.timesteps.numpy(), rtol=1e-5)
    assert [(batch, g) for batch, _, g in calls] == [(1, [3.5])] * 3
    found = parameters(plain)
    assert (found["Sampler"], found["CFG scale"], found["Distilled CFG Scale"]) == (
        "Euler",
        "1.0",
        "3.5",
    )
    calls.clear()
    [other] = run(txt2img, models["flux"], tmp_path / "b", "--steps", "3", "--guidance", "2")
    assert [g for _, _, g in calls] == [[2.0]] * 3
    assert parameters(other)["Distilled CFG Scale"] == "2.0"
    assert not np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(other)))


def test_flux_refuses_a_ddpm_sampler_in_one_line(models, tmp_path, capsys):
    argv = [*models["flux"], "--outdir", str(tmp_path), "--sampler", "dpmpp_2m"]
    line = one_line_exit(capsys, txt2img.main, argv)
    assert line == "error: --sampler dpmpp_2m: a flow model (SD3, Flux) samples with euler or heun"


# --- init images --------------------------------------------------------------------------------
def test_init_image_transparency_is_white_and_16_bit_gray_is_scaled(tmp_path):
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    Image.new("I;16", (4, 4), 32768).save(tmp_path / "gray16.png")
    Image.new("L", (4, 4), 90).save(tmp_path / "gray8.png")
    assert np.asarray(open_init_image(tmp_path / "clear.png")).min() == 255
    assert np.unique(np.asarray(open_init_image(tmp_path / "gray16.png"))).tolist() == [128]
    assert np.unique(np.asarray(open_init_image(tmp_path / "gray8.png"))).tolist() == [90]


# --- class-conditional DiT ----------------------------------------------------------------------
def test_class_dit_guides_against_the_null_class(models, tmp_path, capsys, calls):
    [png] = run(txt2img, models["class"], tmp_path, "--class", "3", "--steps", "2", "--scale", "4")
    assert [batch for batch, _, _ in calls] == [2, 2]
    found = parameters(png)
    assert (found["Prompt"], found["Size-1"], found.get("Negative prompt", "")) == (
        "class 3",
        "16",
        "",
    )
    argv = [*models["class"], "--outdir", str(tmp_path), "--class", "3", "--negative-prompt", "x"]
    line = one_line_exit(capsys, txt2img.main, argv)
    assert line.startswith("error: --negative-prompt: a class-conditional model guides against")
    (tmp_path / "prompts.txt").write_text("a cat\n")
    argv = [*models["class"], "--outdir", str(tmp_path), "--class", "3", "--from-file"]
    line = one_line_exit(capsys, txt2img.main, [*argv, str(tmp_path / "prompts.txt")])
    assert line.startswith("error: --from-file: this model draws classes")


def test_sd3_size_above_its_position_table_names_the_flag(models, tmp_path, capsys):
    argv = [*models["sd3"], "--outdir", str(tmp_path), "--W", "512"]
    assert one_line_exit(capsys, txt2img.main, argv).startswith("error: --W 512: at most 64 ")
