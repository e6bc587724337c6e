"""LoRA under the 2-process strategies on CPU (DDP, DeepSpeed ZeRO-2, FSDP), through the launcher:
the run trains the adapters and nothing else, its checkpoint (a file, or DeepSpeed's folder
merged by `lun.strategies.load_training_checkpoint`) is the original layout plus `lora.*`, with
the EMA of the adapters, and `scripts/lora.py export` writes the kohya file of those adapters."""

import lora as lora_script
import pytest
import torch
from lora_helpers import build
from run_helpers import ROOT, failure_lines, free_ports, start_main
from safetensors.torch import load_file

from ldm import checkpoint
from ldm.layout.ema import EMA_SCALARS
from lun.strategies import load_training_checkpoint

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
LORA = "{rank: 2, alpha: 4, targets: [attn, conv], text_encoder: {rank: 2}}"


PRESETS = ["ddp", "deepspeed_stage2", "fsdp"]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory, shapes_dir):
    """The 2-process LoRA run of each preset this session's tests ask for, started at once: a
    launch leaves a core idle much of its start-up (rank 1 starts once rank 0 is set up), so the
    runs go side by side, each with a rendezvous port of its own. preset -> (its folder, its
    process, the base's weights)."""
    wanted = [
        item.callspec.params["preset"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    folder = tmp_path_factory.mktemp("lora_strategies")
    base = folder / "base.safetensors"  # "pretrained": a fresh UNet's zero output layer
    start = build(TINY, None).state_dict()  # would give the adapters no gradient
    checkpoint.save_safetensors(start, base)
    runs = {}
    for preset, port in zip(wanted, free_ports(len(wanted)), strict=True):
        tmp_path = folder / preset
        tmp_path.mkdir()
        args = ["--base", str(TINY), str(ROOT / "configs" / "lightning" / f"{preset}.yaml")]
        args += ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]
        args += [f"data.params.train.params.data_root={shapes_dir}"]
        args += ["-l", str(tmp_path / "logs"), "-n", "run"]
        args += [f"model.params.lora={LORA}", f"model.params.ckpt_path={base}"]
        args += ["model.params.use_ema=true", "-t"]
        process = start_main(args, tmp_path, tmp_path / "stderr.txt", port)
        runs[preset] = (tmp_path, process, start)
    yield runs
    for _, process, _ in runs.values():  # a test that failed first leaves no run going
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_lora_trains_saves_and_exports_under_two_processes(launched, preset):
    tmp_path, process, start = launched[preset]
    logs = tmp_path / "logs"
    returncode = process.wait(timeout=600)
    assert returncode == 0, failure_lines((tmp_path / "stderr.txt").read_text())
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
