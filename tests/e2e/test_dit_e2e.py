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
    # The released model learns its variances (learn_sigma): DiT's own sampler uses them.
    learned = [*args, "--class", "2", "--steps", "2", "--sampler", "ddpm_learned", "--scale", "4"]
    txt2img.main([*learned, "--outdir", str(tmp_path / "learned")])
    (png,) = (tmp_path / "learned" / "samples").glob("*.png")
    with Image.open(png) as image:
        assert "Sampler: DDPM," in image.text["parameters"]


@pytest.mark.slow
def test_fsdp_wraps_dit_blocks_and_saves_the_released_names(tmp_path, shape_classes_dir):
    """A DiT trains under configs/lightning/fsdp-dit.yaml (one CPU process), and the checkpoint
    keeps the plain names (no wrapper levels)."""
    preset = ROOT / "configs" / "lightning" / "fsdp-dit.yaml"
    args = ["--base", str(SHAPES_DIT), str(preset)]
    args += [f"data.params.train.params.data_root={shape_classes_dir}", *TINY[:-3]]
    args += ["lightning.trainer.max_steps=2", "lightning.trainer.accelerator=cpu"]
    args += ["lightning.trainer.devices=1", "lightning.callbacks.image_logger=null"]
    result = run_main(
        [*args, "-l", str(tmp_path), "-t"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    state = load_training_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]
    assert "model.diffusion_model.blocks.0.attn.qkv.weight" in state
    assert not any("_fsdp_wrapped_module" in k for k in state)


def test_the_fsdp_preset_makes_each_dit_block_a_unit(tmp_path):
    """The preset's wrap policy, applied by torch FSDP (one gloo process): one unit per block."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ldm.dit import DiT
    from ldm.util import instantiate_from_config

    preset = OmegaConf.load(ROOT / "configs" / "lightning" / "fsdp-dit.yaml")
    strategy = instantiate_from_config(OmegaConf.to_container(preset.lightning.strategy))
    policy = strategy.kwargs["auto_wrap_policy"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = DiT(input_size=8, patch_size=2, hidden_size=32, depth=3, num_heads=2, num_classes=4)
        # use_orig_params as Lightning sets it: the frozen pos_embed shares the root unit
        cpu = torch.device("cpu")
        wrapped = FSDP(model, auto_wrap_policy=policy, device_id=cpu, use_orig_params=True)
        units = [name for name, m in wrapped.named_modules() if isinstance(m, FSDP)]
        assert len(units) == 1 + 3  # the root and each of the 3 blocks
        assert all(name.endswith(tuple(f"blocks.{i}" for i in range(3))) for name in units[1:])
    finally:
        dist.destroy_process_group()
