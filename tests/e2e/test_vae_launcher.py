"""Every autoencoder config (configs/autoencoder/*.yaml, configs/tiny/vae.yaml) trains 2 steps through the launcher at toy size."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import run_main_here
from safetensors.torch import save_file

from ldm.autoencoder import AutoencoderKL
from ldm.autoencoder_training import autoencoder_kl

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(  # the configs whose model is an autoencoder, wherever they are
    p
    for p in (ROOT / "configs").glob("**/*.yaml")
    if "autoencoder" in str(OmegaConf.select(OmegaConf.load(p), "model.target", default=""))
)
DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
    num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
LOSS = {
    "target": "ldm.vae_loss.LPIPSWithDiscriminator",
    "params": {"disc_start": 0, "perceptual_weight": 0.0, "disc_ndf": 8, "disc_num_layers": 2},
}
TINY = {"ch": 32, "ch_mult": "[1,2]", "num_res_blocks": 1, "resolution": 32}


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_autoencoder_config_trains_two_steps(config, tmp_path, shapes_dir):
    overrides = [f"model.params.ddconfig.{k}={v}" for k, v in TINY.items()] + [
        f"data.params.train.params.data_root={shapes_dir}",
        "data.params.train.params.size=32",
        "data.params.batch_size=2",
        "data.params.num_workers=0",
        "model.params.lossconfig.params.perceptual_weights=random",
        "model.params.lossconfig.params.disc_start=1",
        "lightning.trainer.max_steps=2",
        "lightning.trainer.accelerator=cpu",
        "lightning.trainer.precision=32-true",
    ]
    start = None
    if "ckpt_path" in config.read_text():
        # A model file holding the config's kind of VAE (SD3's: 16 channels, no quant_conv).
        params = OmegaConf.load(config).model.params
        z = params.ddconfig.z_channels
        dd = dict(double_z=True, z_channels=z, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2])
        dd |= dict(num_res_blocks=1, attn_resolutions=[], dropout=0.0, resolution=32)
        vae = AutoencoderKL(dd, params.embed_dim, use_quant_conv=params.get("use_quant_conv", True))
        start = {f"first_stage_model.{k}": v for k, v in vae.state_dict().items()}
        save_file(start, tmp_path / "sd.safetensors")
        overrides.append(f"model.params.ckpt_path={tmp_path / 'sd.safetensors'}")
    logs = tmp_path / "logs"
    # In this process (as tests/e2e/test_configs.py's runs): a subprocess would spend its time
    # importing torch and Lightning again; the launcher's code is the same.
    result = run_main_here(["--base", str(config), *overrides, "-l", str(logs), "-t"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = logs.iterdir()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 2  # one step per batch, two optimizers
    state = ckpt["state_dict"]
    assert "decoder.conv_out.weight" in state and "loss.discriminator.main.0.weight" in state
    if start is not None:  # train_decoder_only: the encoder is as loaded, the decoder moved
        enc = "encoder.conv_in.weight"
        assert torch.equal(state[enc], start[f"first_stage_model.{enc}"])
        dec = "decoder.conv_out.weight"
        assert not torch.equal(state[dec], start[f"first_stage_model.{dec}"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, key, says",
    [
        ("deepspeed", "lightning.strategy:", "use strategy: ddp or fsdp"),
        ("ddp", "lightning.strategy.params.find_unused_parameters:", "must be true"),
    ],
)
def test_strategies_it_cannot_run_are_one_line_before_the_run_folder(
    tmp_path, shapes_dir, strategy, key, says
):
    """Two optimizers by manual optimization: not under DeepSpeed (one optimizer), and under DDP
    only with find_unused_parameters (configs/lightning/ddp.yaml has it false). FSDP runs
    (tests/e2e/test_vae_resume.py)."""
    logs = tmp_path / "logs"
    args = ["--base", str(ROOT / "configs" / "autoencoder" / "tiny.yaml")]
    if strategy == "ddp":
        args.append(str(ROOT / "configs" / "lightning" / "ddp.yaml"))
    else:
        args.append(f"lightning.strategy={strategy}")
    args += [
        f"data.params.train.params.data_root={shapes_dir}",
        "lightning.trainer.accelerator=cpu",
    ]
    result = run_main_here([*args, "lightning.trainer.devices=2", "-l", logs, "-t"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert key in line and says in line and "Traceback" not in result.stderr
    assert not logs.exists() or not any(logs.iterdir())


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_gradient_clipping_is_refused_in_one_line_before_the_run_folder(
    tmp_path, shapes_dir, strategy
):
    """Lightning does not clip a module that steps its own optimizers: `gradient_clip_val` on
    the VAE stopped its fit at the first batch (a traceback, the run folder made). Under FSDP the
    clipping is our callback's (lun.trainer.FSDPGradientClipping): refused the same way."""
    logs = tmp_path / "logs"
    args = [
        "--base",
        str(ROOT / "configs" / "autoencoder" / "tiny.yaml"),
        f"data.params.train.params.data_root={shapes_dir}",
        "lightning.trainer.accelerator=cpu",
        "lightning.trainer.gradient_clip_val=1.0",
        f"lightning.strategy={strategy}",
    ]
    if strategy == "fsdp":
        args.append("lightning.trainer.devices=2")
    result = run_main_here([*args, "-l", logs, "-t"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert "lightning.trainer.gradient_clip_val:" in line and "manual optimization" in line
    assert "Traceback" not in result.stderr
    assert not logs.exists() or not any(logs.iterdir())


def test_fsdp_resume_is_refused_in_one_line():
    """FSDP trains the VAE (tests/e2e/test_vae_resume.py), but its checkpoints' optimizer states do
    not match the weights: `--resume` under FSDP stops with a config error naming the way out."""
    from lun.config import ConfigError
    from lun.run import check_strategy_fits
    from lun.strategies import build_strategy

    model = autoencoder_kl(ddconfig=DDCONFIG, lossconfig=LOSS, embed_dim=4)
    strategy = build_strategy({"target": "lun.strategies.FSDPStrategy"})
    check_strategy_fits(model, strategy)  # a new run: accepted
    with pytest.raises(ConfigError, match=r"^--resume: .*model.params.ckpt_path="):
        check_strategy_fits(model, strategy, resuming=True)
