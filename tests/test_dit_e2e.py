"""DiT end to end: the shapes demo config trains through main.py (EMA, class-grid image logger),
then txt2img --class samples it with DDIM and DPM++ under guidance, and eval_shapes scores it;
a released-format DiT .pt samples through txt2img."""

import json
import os

import eval_shapes
import pytest
import torch
import txt2img
from PIL import Image
from run_helpers import ROOT, run_main

from lun.strategies import load_training_checkpoint

SHAPES_DIT = ROOT / "configs" / "dit" / "shapes-dit.yaml"
TINY = [  # the demo's DiT at toy width, 3 steps, a class grid at step 2
    "model.params.backbone_config.params.hidden_size=32",
    "model.params.backbone_config.params.depth=1",
    "model.params.backbone_config.params.num_heads=2",
    "model.params.backbone_config.params.learn_sigma=true",
    "data.params.batch_size=4",
    "lightning.trainer.max_steps=3",
    "lightning.callbacks.image_logger.params.batch_frequency=2",
    "lightning.callbacks.image_logger.params.max_images=4",
    "lightning.callbacks.image_logger.params.steps=2",
]


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory, shape_classes_dir):
    logs = tmp_path_factory.mktemp("dit_logs")
    args = ["--base", str(SHAPES_DIT), f"data.params.train.params.data_root={shape_classes_dir}"]
    result = run_main(
        [*args, *TINY, "-l", str(logs), "-t"],
        cwd=logs,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = logs.iterdir()
    return run


@pytest.mark.slow
def test_the_demo_config_trains_with_ema_and_a_class_grid(dit_run):
    trained = load_training_checkpoint(dit_run / "checkpoints" / "last.ckpt")
    assert trained["global_step"] == 3
    state = trained["state_dict"]
    assert "model.diffusion_model.y_embedder.embedding_table.weight" in state
    assert state["model.diffusion_model.y_embedder.embedding_table.weight"].shape == (19, 32)
    assert any(k.startswith("model_ema.") for k in state)  # the EMA callback's shadows
    (grid,) = (dit_run / "images" / "train").glob("samples_gs-000002*.png")
    settings = json.loads(Image.open(grid).text["parameters"])
    assert settings["prompts"] == [0, 1, 2, 3]  # the fixed class grid of the config


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["ddim", "dpmpp_2m"])
def test_txt2img_draws_classes_with_guidance(dit_run, tmp_path, sampler):
    ckpt = dit_run / "checkpoints" / "last.ckpt"
    common = ["--ckpt", str(ckpt), "--steps", "3", "--n_samples", "2", "--skip_grid"]
    args = [*common, "--class", "4", "17", "--sampler", sampler, "--scale", "3"]
    txt2img.main([*args, "--outdir", str(tmp_path / "a")])
    paths = sorted((tmp_path / "a" / "samples").glob("*.png"))
    assert len(paths) == 4 and Image.open(paths[0]).size == (16, 16)
    assert Image.open(paths[0]).text["parameters"].startswith("class 4\n")
    assert Image.open(paths[2]).text["parameters"].startswith("class 17\n")


@pytest.mark.slow
def test_eval_shapes_scores_a_class_conditional_model(dit_run, capsys):
    ckpt = dit_run / "checkpoints" / "last.ckpt"
    eval_shapes.main(["--ckpt", str(ckpt), "--n", "1", "--steps", "2", "--verbose"])
    out = capsys.readouterr().out
    assert "class 0 (blue circle)" in out and "class 17 (yellow triangle)" in out
    assert "colour accuracy" in out.lower()


@pytest.mark.slow
def test_a_released_format_dit_file_samples_through_txt2img(tmp_path):
    """A flat DiT state dict (the DiT-XL-2-256x256.pt format) with a config naming its size."""
    from omegaconf import OmegaConf

    from ldm.dit import DiT

    params = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=2)
    config = {
        "model": {
            "target": "ldm.diffusion.LatentDiffusion",
            "params": {
                "backbone_config": {
                    "target": "ldm.dit.DiT",
                    "params": {**params, "num_classes": 5},
                },
                "first_stage_config": {"target": "ldm.autoencoder.IdentityFirstStage"},
                "conditioner_config": {
                    "target": "ldm.conditioning.ClassLabels",
                    "params": {"num_classes": 5},
                },
                "scale_factor": 1.0,
            },
        }
    }
    OmegaConf.save(config, tmp_path / "dit.yaml")
    torch.manual_seed(0)
    model = DiT(**params, num_classes=5)
    torch.save(model.state_dict(), tmp_path / "DiT-tiny.pt")
    args = ["--config", str(tmp_path / "dit.yaml"), "--ckpt", str(tmp_path / "DiT-tiny.pt")]
    txt2img.main([*args, "--class", "2", "--steps", "2", "--outdir", str(tmp_path / "out")])
    assert len(list((tmp_path / "out" / "samples").glob("*.png"))) == 1
