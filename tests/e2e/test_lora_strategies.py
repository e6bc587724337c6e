"""LoRA under the 2-process strategies on CPU (DDP, DeepSpeed ZeRO-2, FSDP), through the launcher:
the run trains the adapters and nothing else, its checkpoint (a file, or DeepSpeed's folder
merged by `lun.strategies.load_training_checkpoint`) is the original layout plus `lora.*`, with
the EMA of the adapters, and `scripts/lora.py export` writes the kohya file of those adapters."""

import lora as lora_script
import pytest
import torch
from lora_helpers import build
from run_helpers import ROOT, run_main
from safetensors.torch import load_file

from ldm import checkpoint
from ldm.layout.ema import EMA_SCALARS
from lun.strategies import load_training_checkpoint

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
LORA = "{rank: 2, alpha: 4, targets: [attn, conv], text_encoder: {rank: 2}}"


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ddp", "deepspeed_stage2", "fsdp"])
def test_lora_trains_saves_and_exports_under_two_processes(tmp_path, shapes_dir, preset):
    base = tmp_path / "base.safetensors"  # "pretrained": a fresh UNet's zero output layer
    start = build(TINY, None).state_dict()  # would give the adapters no gradient
    checkpoint.save_safetensors(start, base)
    logs = tmp_path / "logs"
    args = ["--base", str(TINY), str(ROOT / "configs" / "lightning" / f"{preset}.yaml")]
    args += ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]
    args += [f"data.params.train.params.data_root={shapes_dir}", "-l", str(logs), "-n", "run"]
    args += [f"model.params.lora={LORA}", f"model.params.ckpt_path={base}"]
    result = run_main([*args, "model.params.use_ema=true", "-t"], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = logs.iterdir()
    last = run / "checkpoints" / "last.ckpt"
    saved = load_training_checkpoint(last)
    state = saved["state_dict"]
    assert saved["global_step"] == 2

    # The original layout: every base weight under its name, unchanged; adapters apart.
    assert {k for k in state if not k.startswith(("lora.", "model_ema."))} == set(start)
    changed = [k for k in start if not torch.equal(state[k].float(), start[k])]
    assert not changed, f"frozen weights changed: {changed[:3]}"
    adapters = {k: v for k, v in state.items() if k.startswith("lora.")}
    assert not any("base_layer" in k or ".default." in k for k in state)
    ups = {k: v for k, v in adapters.items() if k.endswith("lora_B.weight")}
    assert any(k.startswith("lora.cond_stage_model.") for k in ups)
    assert all(v.abs().max() > 0 for v in ups.values()), "an adapter did not train"
    shadows = [k for k in state if k.startswith("model_ema.") and k not in EMA_SCALARS]
    assert len(shadows) == len([k for k in adapters if k.startswith("lora.model.")])

    out = tmp_path / "kohya.safetensors"
    lora_script.main(["export", str(last), str(out)])
    kohya = load_file(out)
    name = "attentions_0_transformer_blocks_0_attn2_to_k"
    up = kohya[f"lora_unet_down_blocks_0_{name}.lora_up.weight"]
    ours = "lora.model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k"
    assert torch.equal(up, adapters[f"{ours}.lora_B.weight"].float())
    assert len([k for k in kohya if k.endswith(".lora_up.weight")]) == len(ups)
