"""A LoRA run end to end: the launcher trains adapters only (with EMA of the adapters), its
checkpoint is the original layout plus `lora.*`, scripts/lora.py exports and merges it."""

import lora as lora_script
import pytest
import torch
from run_helpers import run_main_here, train_here
from safetensors.torch import load_file

from ldm import checkpoint
from ldm.layout.ema import EMA_SCALARS
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

SETTINGS = "{rank: 2, alpha: 4, targets: [attn, proj, ff, conv], conv_rank: 3}"


@pytest.mark.slow
def test_lora_run_export_and_merge(tmp_path, tiny_config, shapes_dir):
    # main() in this process: a subprocess adds only another start-up of torch and Lightning.
    run = train_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            f"model.params.lora={SETTINGS}",
            "model.params.use_ema=true",
        ],
        logs=tmp_path / "logs",
        cwd=tmp_path,
    )
    ckpt = run / "checkpoints" / "last.ckpt"
    state = checkpoint.state_dict_of(checkpoint.load_file_state(ckpt))
    plain = to_container(merge_configs([tiny_config]))["model"]
    base_keys = set(instantiate_from_config(plain).state_dict())
    assert {k for k in state if not k.startswith(("lora.", "model_ema."))} == base_keys
    adapters = [k for k in state if k.startswith("lora.")]
    assert adapters and not any("base_layer" in k or ".default." in k for k in state)
    # EMA of the adapters only, named without peft's levels.
    shadows = [k for k in state if k.startswith("model_ema.") and k not in EMA_SCALARS]
    assert len(shadows) == len([k for k in adapters if k.startswith("lora.model.")])

    out = tmp_path / "kohya.safetensors"
    lora_script.main(["export", str(ckpt), str(out)])
    kohya = load_file(out)
    assert "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight" in kohya
    assert kohya["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].shape == (3, 32, 3, 3)

    merged = tmp_path / "merged.safetensors"
    lora_script.main(["merge", str(ckpt), str(merged)])
    model = instantiate_from_config(plain).eval()
    checkpoint.load_weights(model, merged)  # strict: a plain original-layout checkpoint
    configs = sorted((run / "configs").glob("*.yaml"))
    with_adapters = instantiate_from_config(to_container(merge_configs(configs))["model"]).eval()
    checkpoint.load_weights(with_adapters, ckpt, ema=False)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"crossattn": torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        expected = with_adapters.apply_model(x, torch.tensor([300]), cond)
        torch.testing.assert_close(
            model.apply_model(x, torch.tensor([300]), cond), expected, rtol=0, atol=1e-5
        )


def test_bad_lora_setting_is_a_config_error_before_the_run_folder(
    tmp_path, tiny_config, shapes_dir
):
    result = run_main_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            "model.params.lora={rank: 4, targets: [attention]}",
            "-l",
            str(tmp_path / "logs"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "model.params.lora.targets" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
