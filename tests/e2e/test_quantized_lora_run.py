"""A LoRA run on a quantized frozen base through main.py: the plan counts the quantized base,
the adapters learn (the loss on fixed noise falls from the untrained adapters'), the checkpoint
is the plain layout (it loads into a model built without quantization), and the exported kohya
file merges with the existing loader into the same model the adapters make."""

import json

import lora as lora_script
import pytest
import torch
from run_helpers import pretrained_base, refused_here, train_here
from safetensors.torch import load_file

from ldm import checkpoint, lora
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


def fixed_loss(model, batch) -> float:
    """The diffusion loss averaged over fixed noise and timesteps (no dropout of the caption)."""
    model.eval()
    with torch.no_grad():
        losses = [
            model.diffusion_loss(batch, torch.Generator().manual_seed(s))[0] for s in range(8)
        ]
    return torch.stack(losses).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_lora_on_a_quantized_base_trains_and_exports(tmp_path, tiny_config, shapes_dir, kind):
    if kind == "int8":
        pytest.importorskip("bitsandbytes")
    plain_config = pretrained_base(tiny_config, tmp_path / "base.ckpt")
    # main.py's main() in this process: a subprocess adds only another start-up of torch and
    # Lightning (the launch as users type it: tests/e2e/test_main.py).
    run = train_here(
        [
            "--base",
            str(tiny_config),
            str(tiny_config.parent / "lora.yaml"),
            f"data.params.train.params.data_root={shapes_dir}",
            f"model.params.ckpt_path={tmp_path / 'base.ckpt'}",
            f"model.params.lora.base_quantization={kind}",
            "model.base_learning_rate=1.0e-2",
            "lightning.trainer.max_steps=8",
        ],
        logs=tmp_path / "logs",
        cwd=tmp_path,
    )
    ckpt = run / "checkpoints" / "last.ckpt"
    plan = json.loads((run / "memory-plan.json").read_text())
    (frozen,) = [p for p in plan["parts"] if p["name"] == "frozen: model"]
    assert ("uint8" if kind == "fp8" else "int8") in frozen["detail"]  # the real bytes counted

    # The checkpoint holds the plain base (original keys, float weights): a model built
    # without quantization loads it strictly.
    configs = sorted((run / "configs").glob("*.yaml"))
    trained = instantiate_from_config(to_container(merge_configs(configs))["model"])
    checkpoint.load_weights(trained, ckpt, ema=False)
    from lun.data.local import Local

    data = Local(str(shapes_dir), size=32)
    batch = torch.utils.data.default_collate([data[i] for i in range(8)])
    after = fixed_loss(trained, batch)
    for name, p in trained.named_parameters():  # the adapters as they started: B = 0
        if ".lora_B." in name:
            p.data.zero_()
    before = fixed_loss(trained, batch)
    assert after < before, (before, after)

    # The kohya file merges with the existing loader into the model the adapters make.
    out = tmp_path / "kohya.safetensors"
    lora_script.main(["export", str(ckpt), str(out)])
    plain = instantiate_from_config(plain_config).eval()
    checkpoint.load_weights(plain, ckpt, ema=False, strict=False)
    assert lora.merge_file(plain, load_file(out), source=str(out)) > 0
    with_adapters = instantiate_from_config(to_container(merge_configs(configs))["model"]).eval()
    checkpoint.load_weights(with_adapters, ckpt, ema=False)
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = {"crossattn": torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        expected = with_adapters.apply_model(x, torch.tensor([300]), cond)
        torch.testing.assert_close(
            plain.apply_model(x, torch.tensor([300]), cond), expected, rtol=0, atol=1e-5
        )


def test_an_unknown_quantization_is_one_line_before_the_run_folder(
    tmp_path, tiny_config, shapes_dir
):
    line = refused_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            "model.params.lora={rank: 4, base_quantization: int4}",
        ],
        tmp_path / "logs",
        cwd=tmp_path,
    )
    assert "model.params.lora.base_quantization: must be one of none, int8, nf4, fp8, auto" in line
