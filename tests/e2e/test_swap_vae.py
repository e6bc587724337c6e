"""scripts/swap_vae.py: a trained VAE into an SD checkpoint's first_stage_model.*, or alone."""

import torch
from safetensors.torch import load_file, save_file
from swap_vae import main

from ldm.autoencoder import AutoencoderKL
from ldm.autoencoder_training import autoencoder_kl

DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32,
    ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
LOSS = {
    "target": "ldm.modules.losses.LPIPSWithDiscriminator",
    "params": {"disc_start": 0, "perceptual_weight": 0.0, "disc_ndf": 8, "disc_num_layers": 2},
}


def test_swap_replaces_every_vae_weight_and_nothing_else(tmp_path, capsys):
    torch.manual_seed(0)
    trained = autoencoder_kl(ddconfig=DDCONFIG, lossconfig=LOSS, embed_dim=4)
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "vae.ckpt")
    old = AutoencoderKL(DDCONFIG, 4)
    sd = {f"first_stage_model.{k}": v for k, v in old.state_dict().items()}
    sd["model.diffusion_model.out.2.weight"] = torch.ones(4, 4)
    save_file(sd, tmp_path / "sd.safetensors")
    out = tmp_path / "swapped.safetensors"
    args = ["--vae", str(tmp_path / "vae.ckpt"), "--ckpt", str(tmp_path / "sd.safetensors")]
    assert main([*args, "--out", str(out)]) == 0
    swapped = load_file(out)
    assert set(swapped) == set(sd)
    assert torch.equal(swapped["model.diffusion_model.out.2.weight"], torch.ones(4, 4))
    for name, value in trained.state_dict().items():
        if not name.startswith("loss."):
            assert torch.equal(swapped[f"first_stage_model.{name}"], value), name
    # Alone: the bare VAE names, loadable as first_stage_config.params.ckpt_path.
    alone = tmp_path / "vae.safetensors"
    assert main(["--vae", str(tmp_path / "vae.ckpt"), "--out", str(alone)]) == 0
    AutoencoderKL(DDCONFIG, 4, ckpt_path=str(alone))


def test_mismatched_vae_is_one_line_exit_2(tmp_path, capsys):
    small = dict(DDCONFIG, ch=64)
    save_file(AutoencoderKL(small, 4).state_dict(), tmp_path / "vae.safetensors")
    sd = {f"first_stage_model.{k}": v for k, v in AutoencoderKL(DDCONFIG, 4).state_dict().items()}
    save_file(sd, tmp_path / "sd.safetensors")
    args = ["--vae", str(tmp_path / "vae.safetensors"), "--ckpt", str(tmp_path / "sd.safetensors")]
    assert main([*args, "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected" in err[0]
