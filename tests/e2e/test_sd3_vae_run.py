"""configs/sd3/vae-finetune.yaml at toy width through main.py: the 16-channel VAE without
quant_conv trains from an SD3-layout file (its `first_stage_model.*`), keeps EMA shadows of
exactly its own weights, resumes; an SD 4-channel VAE given to it (or the reverse) is one line."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, run_main, run_main_here
from safetensors.torch import load_file

from ldm.autoencoder import AutoencoderKL
from ldm.checkpoint import save_safetensors
from ldm.layout.ema import EMA_SCALARS, ema_key

SD3_VAE = ROOT / "configs" / "sd3" / "vae-finetune.yaml"
SD_VAE = ROOT / "configs" / "autoencoder" / "sd-vae-finetune.yaml"
TINY = {"ch": 32, "ch_mult": "[1,2]", "num_res_blocks": 1, "resolution": 32}


def tiny_vae(config: Path) -> AutoencoderKL:
    """The config's VAE at toy width (its own z_channels, embed_dim and use_quant_conv)."""
    params = OmegaConf.load(config).model.params
    dd = {**OmegaConf.to_container(params.ddconfig), "ch": 32, "ch_mult": [1, 2]}
    dd |= {"num_res_blocks": 1, "resolution": 32}
    return AutoencoderKL(dd, params.embed_dim, use_quant_conv=params.get("use_quant_conv", True))


def args(config: Path, start: Path, shapes_dir: Path, logs: Path, steps: int) -> list[str]:
    return [
        "--base", str(config),
        *[f"model.params.ddconfig.{k}={v}" for k, v in TINY.items()],
        f"model.params.ckpt_path={start}",
        f"data.params.train.params.data_root={shapes_dir}",
        "data.params.train.params.size=32",
        "data.params.batch_size=2",
        "data.params.num_workers=0",
        "model.params.lossconfig.params.perceptual_weight=0",  # VGG16: seconds a step on CPU
        "model.params.lossconfig.params.disc_start=1",
        "model.params.use_ema=true",
        f"lightning.trainer.max_steps={steps}",
        "lightning.trainer.accelerator=cpu",
        "lightning.trainer.precision=32-true",
        "lightning.logger=false",
        "-l", str(logs), "-t",
    ]  # fmt: skip


def sd3_file(path: Path, config: Path = SD3_VAE) -> Path:
    """A model file holding the VAE under `first_stage_model.`, as Stability's single files."""
    torch.manual_seed(0)
    vae = tiny_vae(config).state_dict()
    save_safetensors({f"first_stage_model.{k}": v for k, v in vae.items()}, path)
    return path


@pytest.mark.slow
def test_the_sd3_vae_trains_keeps_ema_and_resumes(tmp_path, shapes_dir):
    """Two launches (~40 s on 2 busy cores): a run, and its resume - the strict load of a
    checkpoint without quant_conv, EMA included."""
    start = sd3_file(tmp_path / "sd3.safetensors")
    logs = tmp_path / "logs"
    first = run_main(args(SD3_VAE, start, shapes_dir, logs, 2), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = logs.iterdir()
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    state = saved["state_dict"]
    own = set(tiny_vae(SD3_VAE).state_dict())
    assert not any("quant_conv" in k for k in state)
    assert {k for k in state if k.startswith(("encoder.", "decoder."))} == own
    # EMA shadows of exactly the VAE's trained weights (train_decoder_only: the decoder's).
    shadows = {k for k in state if k.startswith("model_ema.")} - set(EMA_SCALARS)
    assert shadows == {ema_key(k) for k in own if k.startswith("decoder.")}
    original = load_file(start)
    enc, dec = "encoder.conv_out.weight", "decoder.conv_in.weight"
    assert state[enc].shape == (32, 64, 3, 3) and state[dec].shape == (64, 16, 3, 3)
    assert torch.equal(state[enc], original[f"first_stage_model.{enc}"])  # train_decoder_only
    assert not torch.equal(state[dec], original[f"first_stage_model.{dec}"])

    resumed = run_main_here(  # in this process: the first launch was the command line's
        [
            "--resume",
            str(run),
            "lightning.trainer.max_steps=4",
            "lightning.trainer.accelerator=cpu",
            "-t",
        ],
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert again["global_step"] == 4


@pytest.mark.parametrize(
    "config, other, found, give",
    [
        (SD3_VAE, SD_VAE, "holds an SD VAE (4 latent channels", "an SD 3/3.5 VAE"),
        (SD_VAE, SD3_VAE, "holds a 16-channel SD3 VAE", "an SD 1.x/2.x/SDXL VAE"),
    ],
    ids=["sd-vae-for-sd3", "sd3-vae-for-sd"],
)
def test_a_vae_of_the_other_kind_is_one_line_before_the_run(
    tmp_path, shapes_dir, config, other, found, give
):
    start = sd3_file(tmp_path / "other.safetensors", other)
    result = run_main_here(args(config, start, shapes_dir, tmp_path / "logs", 2), tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    # Found as the model is built: after the data's progress lines (INFO), one error line.
    *progress, line = result.stderr.strip().splitlines()
    assert not [p for p in progress if "error" in p.lower() or "Traceback" in p], progress
    assert "model.params.ckpt_path" in line and str(start) in line
    assert found in line and give in line
    assert not (tmp_path / "logs").exists()
