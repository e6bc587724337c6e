"""txt2img --vae: the first stage replaced by a VAE file in any of the layouts users have (ours,
an original SD VAE, diffusers' AutoencoderKL as diffusers itself saves it), written to the PNG
as AUTOMATIC1111 writes it; a wrong file is one line, exit 2."""

import hashlib
from pathlib import Path

import pytest
import torch
import txt2img
from PIL import Image
from png_helpers import parse_a1111_parameters
from safetensors.torch import save_file

from ldm.autoencoder import AutoencoderKL
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.generation import load_model

DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32,
    ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def sd_checkpoint(tmp_path_factory, tiny_config) -> Path:
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    path = tmp_path_factory.mktemp("sd") / "sd.safetensors"
    save_file(model.state_dict(), path)
    return path


def diffusers_vae(seed: int):
    """diffusers' AutoencoderKL of the tiny config's shape, with weights that all matter."""
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL

    torch.manual_seed(seed)
    vae = DiffusersAutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[32, 64],
        layers_per_block=1,
        latent_channels=4,
        sample_size=32,
    )
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 0.05)
    return vae.eval()


def args_for(tiny_config, ckpt, outdir, *extra) -> list[str]:
    return [
        "--config", str(tiny_config), "--ckpt", str(ckpt), "--outdir", str(outdir),
        "--prompt", "a red circle", "--steps", "2", "--sampler", "euler", "--seed", "3",
        "--W", "32", "--H", "32", "--skip_grid", "--device", "cpu", *extra,
    ]  # fmt: skip


def txt2img_args(tiny_config, ckpt, outdir, *extra):
    import argparse

    from lun.generation import add_generation_args

    parser = argparse.ArgumentParser()
    add_generation_args(parser)
    return parser.parse_args(args_for(tiny_config, ckpt, outdir, *extra))


@pytest.mark.slow  # imports diffusers
def test_a_diffusers_vae_file_decodes_as_diffusers_does(tmp_path, tiny_config, sd_checkpoint):
    theirs = diffusers_vae(seed=5)
    theirs.save_pretrained(tmp_path / "vae", safe_serialization=True)  # diffusers' own writer
    path = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    parser_args = txt2img_args(tiny_config, sd_checkpoint, tmp_path, "--vae", str(path))
    model = load_model(parser_args)
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.first_stage_model.decode(z)
        expected = theirs.decode(z).sample
        latent = model.first_stage_model.encode(expected).mode()
        their_latent = theirs.encode(expected).latent_dist.mode()
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(latent, their_latent, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["training_ckpt", "sd_vae_ckpt"])
def test_vae_files_of_our_training_and_the_original_layout_load(
    tmp_path, tiny_config, sd_checkpoint, layout
):
    torch.manual_seed(7)
    vae = AutoencoderKL(DDCONFIG, 4).state_dict()
    if layout == "training_ckpt":  # a run of configs/autoencoder: loss.* and EMA keys beside
        state = {**vae, "loss.logvar": torch.zeros(()), "model_ema.decay": torch.tensor(0.9)}
        path = tmp_path / "last.ckpt"
        torch.save({"state_dict": state, "global_step": 2}, path)
    else:  # the layout of vae-ft-mse-840000-ema-pruned.ckpt: {"state_dict": bare names}
        path = tmp_path / "vae-ft-mse.vae.pt"
        torch.save({"state_dict": vae}, path)
    model = load_model(txt2img_args(tiny_config, sd_checkpoint, tmp_path, "--vae", str(path)))
    loaded = model.first_stage_model.state_dict()
    assert loaded.keys() == vae.keys()
    assert all(torch.equal(loaded[k], vae[k]) for k in vae)


def test_txt2img_writes_the_vae_as_automatic1111_does(tmp_path, tiny_config, sd_checkpoint):
    path = tmp_path / "my-vae.safetensors"
    save_file(AutoencoderKL(DDCONFIG, 4).state_dict(), path)
    txt2img.main(args_for(tiny_config, sd_checkpoint, tmp_path, "--vae", str(path)))
    image = Image.open(tmp_path / "samples" / "00000.png")
    fields = parse_a1111_parameters(image.text["parameters"])
    assert fields["VAE hash"] == hashlib.sha256(path.read_bytes()).hexdigest()[:10]
    assert fields["VAE"] == "my-vae.safetensors"
    assert fields["Model hash"] == hashlib.sha256(sd_checkpoint.read_bytes()).hexdigest()[:10]


@pytest.mark.parametrize("wrong", ["unet_only", "other_width", "missing"])
def test_a_wrong_vae_file_is_one_line_exit_2(tmp_path, tiny_config, sd_checkpoint, capsys, wrong):
    path = tmp_path / "vae.safetensors"
    if wrong == "unet_only":
        save_file({"model.diffusion_model.out.2.weight": torch.ones(2)}, path)
    elif wrong == "other_width":
        save_file(AutoencoderKL({**DDCONFIG, "ch": 64}, 4).state_dict(), path)
    with pytest.raises(SystemExit) as exit_info:
        txt2img.main(args_for(tiny_config, sd_checkpoint, tmp_path, "--vae", str(path)))
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and str(path) in line
