"""A LoRA run on the tiny SD 3.5 and Flux.1 dev configs through main.py: 2 steps on a frozen
"pretrained" base, `scripts/lora.py export` writes the kohya file (kohya / ComfyUI names:
`lora_unet_` + the backbone's module, `.` -> `_`), and that file merged into the plain base gives
the trained model's adapters merged by peft (which the 2 steps moved off B = 0)."""

import copy

import lora as lora_script
import numpy as np
import pytest
import torch
import txt2img
from omegaconf import OmegaConf
from PIL import Image
from run_helpers import ROOT, run_main_here
from safetensors.torch import load_file
from sd3_helpers import t5_tokenizer_folder

from ldm import checkpoint, lora
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

CASES = {  # config, a key of its kohya file, the adapted layers (hand-counted)
    "sd3": ("sd3/tiny.yaml", "lora_unet_joint_blocks_0_x_block_attn2_qkv", 15),
    "flux": ("flux/tiny.yaml", "lora_unet_single_blocks_0_linear1", None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tiny_lora_run_trains_and_exports_kohya(tmp_path, shapes_dir, case):
    path, key, layers = CASES[case]
    config = ROOT / "configs" / path
    plain_config = OmegaConf.load(config).model
    extra = []
    if case == "flux":
        tokenizer = t5_tokenizer_folder(tmp_path / "t5_tokenizer")
        extra = [f"model.params.conditioner_config.params.t5xxl.tokenizer={tokenizer}"]
        plain_config.params.conditioner_config.params.t5xxl.tokenizer = str(tokenizer)
    plain_config = OmegaConf.to_container(plain_config, resolve=True)
    torch.manual_seed(0)
    base = instantiate_from_config(plain_config)
    with torch.no_grad():  # off the adaLN-Zero / zero output init, which passes no gradient
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": base.state_dict()}, tmp_path / "base.ckpt")
    logs = tmp_path / "logs"
    # In this process: the SD3 and Flux launches as users type them are tests/e2e/test_sd3_e2e.py's
    # and test_flux_e2e.py's; here a subprocess would add only another start-up of torch.
    result = run_main_here(
        [
            *("--base", str(config), f"data.params.train.params.data_root={shapes_dir}"),
            *extra,
            f"model.params.ckpt_path={tmp_path / 'base.ckpt'}",
            "model.params.lora={rank: 4, alpha: 2}",
            "model.base_learning_rate=1.0e-1",  # Adam moves B by ~lr a step: a visible change
            "lightning.trainer.max_steps=2",
            *("-l", str(logs), "-t"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = list(logs.iterdir())
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "lora.safetensors"
    lora_script.main(["export", str(ckpt), str(out)])
    file = load_file(out)
    assert f"{key}.lora_up.weight" in file
    assert float(file[f"{key}.alpha"]) == 2.0
    assert any(file[k].abs().max() > 0 for k in file if k.endswith(".lora_up.weight"))

    configs = sorted((run / "configs").glob("*.yaml"))
    trained = instantiate_from_config(to_container(merge_configs(configs))["model"]).eval()
    checkpoint.load_weights(trained, ckpt, ema=False)
    merged = copy.deepcopy(trained)
    count = lora.merge_adapters(merged)
    assert layers is None or count == layers
    plain = instantiate_from_config(plain_config).eval()
    checkpoint.load_weights(plain, ckpt, ema=False, strict=False)
    assert lora.merge_file(plain, file, source=str(out)) == count
    for k, v in merged.backbone.state_dict().items():
        torch.testing.assert_close(plain.backbone.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)

    # txt2img --lora: the plain base with the kohya file draws the trained run's image
    plain_yaml = tmp_path / "plain.yaml"
    OmegaConf.save({"model": plain_config}, plain_yaml)
    trained_image = generate(tmp_path / "trained", "--ckpt", str(ckpt), "--no-ema")
    with_file = generate(
        tmp_path / "lora",
        *("--config", str(plain_yaml), "--ckpt", str(tmp_path / "base.ckpt")),
        *("--lora", f"{out}:1.0"),
    )
    without = generate(
        tmp_path / "base", "--config", str(plain_yaml), "--ckpt", str(tmp_path / "base.ckpt")
    )
    assert np.abs(with_file - trained_image).max() <= 1  # the PNG's rounding
    assert np.abs(without - trained_image).max() > 1  # the file changed the image


def generate(out, *args) -> np.ndarray:
    txt2img.main(
        [
            *args,
            *("--outdir", str(out), "--sampler", "euler", "--steps", "3", "--scale", "1"),
            *("--prompt", "a red circle", "--n_samples", "1", "--seed", "7", "--skip_grid"),
        ]
    )
    (png,) = sorted((out / "samples").glob("*.png"))
    return np.asarray(Image.open(png), dtype=np.int16)
