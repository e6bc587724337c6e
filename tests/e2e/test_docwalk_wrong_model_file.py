"""docs/errors.md, the two slips a user makes without `--config`: a VAE run's checkpoint (its run
folder's saved config is the VAE's) or a LoRA file given to txt2img as the model. Each is one
line naming what the file is and where it goes, exit status 2 - not a traceback from loading a
VAE as a diffusion model, nor a request for a config the file never had."""

import img2img
import pytest
import torch
import txt2img
from PIL import Image
from run_helpers import ROOT
from safetensors.torch import save_file

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


@pytest.fixture(scope="module")
def wrong_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("docwalk_wrong_files")
    vae_yaml = ROOT / "configs" / "autoencoder" / "tiny.yaml"
    run = out / "2026-01-01T00-00-00_vae"  # a VAE run folder, as main.py writes it
    (run / "configs").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "configs" / "2026-01-01T00-00-00-project.yaml").write_text(vae_yaml.read_text())
    vae = instantiate_from_config(to_container(merge_configs([vae_yaml]))["model"])
    torch.save({"state_dict": vae.state_dict()}, run / "checkpoints" / "last.ckpt")
    lora = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 8)}
    lora |= {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 2)}
    lora |= {"lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(2.0)}
    save_file(lora, out / "my-lora.safetensors")
    return {"vae_run": run / "checkpoints" / "last.ckpt", "lora": out / "my-lora.safetensors"}


@pytest.mark.parametrize("script", [txt2img, img2img], ids=["txt2img", "img2img"])
@pytest.mark.parametrize(
    "name, what, goes_to",
    [("vae_run", "is a VAE checkpoint", "--vae"), ("lora", "is a LoRA file", "--lora")],
)
def test_a_vae_or_lora_as_the_model_is_one_line(
    wrong_files, tmp_path, capsys, script, name, what, goes_to
):
    argv = ["--ckpt", str(wrong_files[name]), "--outdir", str(tmp_path / "out")]
    if script is img2img:
        Image.new("RGB", (32, 32)).save(tmp_path / "init.png")
        argv += ["--init-img", str(tmp_path / "init.png")]
    with pytest.raises(SystemExit) as stop:
        script.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2, lines
    assert len(lines) == 1, lines
    assert what in lines[0] and "expected a diffusion model" in lines[0], lines
    assert goes_to in lines[0], lines
    assert not (tmp_path / "out").exists()
