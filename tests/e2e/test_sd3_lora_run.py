"""A LoRA run on the tiny SD 3.5 (configs/sd3/tiny.yaml) through main.py: 2 steps on a frozen
"pretrained" base, `scripts/lora.py export` writes the kohya file (kohya / ComfyUI's SD3 names),
and that file merged into the plain base gives the output of the model with the trained adapters
(which the 2 steps moved off B = 0)."""

import lora as lora_script
import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, run_main
from safetensors.torch import load_file

from ldm import checkpoint, lora
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

TINY = ROOT / "configs" / "sd3" / "tiny.yaml"


@pytest.mark.slow
def test_tiny_sd3_lora_trains_and_exports_kohya(tmp_path, shapes_dir):
    plain_config = OmegaConf.to_container(OmegaConf.load(TINY).model, resolve=True)
    torch.manual_seed(0)
    base = instantiate_from_config(plain_config)
    with torch.no_grad():  # off the adaLN-Zero / zero output init, which passes no gradient
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": base.state_dict()}, tmp_path / "base.ckpt")
    logs = tmp_path / "logs"
    result = run_main(
        [
            *("--base", str(TINY), f"data.params.train.params.data_root={shapes_dir}"),
            f"model.params.ckpt_path={tmp_path / 'base.ckpt'}",
            "model.params.lora={rank: 4, alpha: 2}",
            "model.base_learning_rate=1.0e-2",
            "lightning.trainer.max_steps=2",
            *("-l", str(logs), "-t"),
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = list(logs.iterdir())
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "sd3-lora.safetensors"
    lora_script.main(["export", str(ckpt), str(out)])
    file = load_file(out)
    # kohya sd-scripts' SD3 network names: lora_unet_ + the MMDiT module, `.` -> `_`
    assert "lora_unet_joint_blocks_0_x_block_attn2_qkv.lora_up.weight" in file
    assert float(file["lora_unet_joint_blocks_1_x_block_mlp_fc2.alpha"]) == 2.0
    assert any(file[k].abs().max() > 0 for k in file if k.endswith(".lora_up.weight"))

    configs = sorted((run / "configs").glob("*.yaml"))
    trained = instantiate_from_config(to_container(merge_configs(configs))["model"]).eval()
    checkpoint.load_weights(trained, ckpt, ema=False)
    plain = instantiate_from_config(plain_config).eval()
    checkpoint.load_weights(plain, ckpt, ema=False, strict=False)
    assert lora.merge_file(plain, file, source=str(out)) == 15
    torch.manual_seed(1)
    x, ctx, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 6, 48), torch.randn(1, 40)
    cond, t = {"crossattn": ctx, "vector": pooled}, torch.tensor([300.0])
    with torch.no_grad():
        expected = trained.backbone(x, t, cond)
        torch.testing.assert_close(plain.backbone(x, t, cond), expected, rtol=0, atol=1e-5)
