"""DreamBooth prior preservation: our loss is eq. 2 of Ruiz et al. 2022 as diffusers'
train_dreambooth_lora.py computes it, and the launcher refuses a bad DreamBooth config before
the run folder exists."""

import json

import pytest
import torch
import torch.nn.functional as F
from lora_helpers import build
from PIL import Image
from run_helpers import ROOT, run_main_here
from safetensors.torch import save_file

from lun.data.dreambooth import DreamBooth

CONFIG = ROOT / "configs" / "stable-diffusion" / "v1-dreambooth-lora.yaml"


def images(path, count, seed):
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(path / f"{i}.png")
    return str(path)


@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_prior_preservation_loss_is_eq2_as_diffusers_computes_it(
    tmp_path, tiny_config, parameterization
):
    data = DreamBooth(
        images(tmp_path / "sks", 2, seed=0),
        "a sks circle",
        class_data_root=images(tmp_path / "class", 3, seed=1),
        class_prompt="a circle",
        prior_loss_weight=0.4,
        size=32,
    )
    # a base whose output depends on x
    overrides = (f"model.params.parameterization={parameterization}",)
    model = build(tiny_config, "{rank: 4, targets: [attn]}", overrides=overrides)
    batch = data.collate([data[0], data[1], data[2]])  # 3 instance, then 3 class images
    # Latents given (as cached ones are): the test knows z without the VAE's sampling.
    z = model.encode_first_stage(batch.pop("image"), torch.Generator().manual_seed(0))
    batch["latent"] = z
    seen = {}

    def keep(module, args, output):
        seen["x_t"], seen["t"], seen["prediction"] = args[0], args[1], output

    model.model.register_forward_hook(keep)
    loss, _, _ = model.diffusion_loss(batch, torch.Generator().manual_seed(1))

    # diffusers' loss on the same predictions: targets from x_t = a z + s eps
    a = model.sqrt_alphas_cumprod[seen["t"]].view(-1, 1, 1, 1)
    s = model.sqrt_one_minus_alphas_cumprod[seen["t"]].view(-1, 1, 1, 1)
    noise = (seen["x_t"] - a * z) / s
    target = noise if parameterization == "eps" else a * noise - s * z
    prediction, prediction_prior = seen["prediction"].float().chunk(2)
    target, target_prior = target.float().chunk(2)
    expected = F.mse_loss(prediction, target) + 0.4 * F.mse_loss(prediction_prior, target_prior)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # and not the plain mean over all six images (the weights matter here)
    assert not torch.isclose(
        loss, F.mse_loss(seen["prediction"], torch.cat([target, target_prior]))
    )


@pytest.mark.slow
def test_a_missing_instance_folder_is_one_line_exit_2_before_the_run_folder(tmp_path):
    logs = tmp_path / "logs"
    # An SD 1.x file as far as the checkpoint check reads (its key names: ldm.layout.family):
    # the data is what this test gets wrong.
    keys = json.loads((ROOT / "tests" / "reference" / "sd_v1_keys.json").read_text())["keys"]
    base = tmp_path / "sd1.safetensors"
    save_file({key: torch.zeros(1) for key in keys}, base)
    result = run_main_here(
        [
            "--base",
            str(CONFIG),
            f"model.params.ckpt_path={base}",
            f"data.params.train.params.data_root={tmp_path / 'no-such-folder'}",
            f"data.params.train.params.class_data_root={tmp_path / 'class'}",
            "-l",
            str(logs),
            "-t",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("config error: data.params.train.params.data_root=")
    assert "not a folder" in lines[-1] and "Traceback" not in result.stderr
    assert not logs.exists() and not (tmp_path / "class").exists()


def test_the_concept_experiment_reads_its_own_instance_images_as_pink_circles(tmp_path):
    import random

    import numpy as np
    from eval_shapes import analyze
    from lora_concept import draw_instances, read_color
    from make_shapes import make_image

    draw_instances(tmp_path, 6, size=16, seed=0)
    for path in sorted(tmp_path.glob("*.png")):
        pixels = np.asarray(Image.open(path))
        assert (read_color(pixels), analyze(pixels).shape) == ("pink", "circle"), path.name
    # the six colours of the base are not read as pink
    for color in ("red", "purple", "orange"):
        image = make_image(random.Random(0), 16, color, "circle", "white", False)
        assert read_color(np.asarray(image)) == color
