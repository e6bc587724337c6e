"""`main.py -t` on a LoRA with block swap: the plan it runs before the run folder holds the
swapped blocks in host RAM (their bytes from the model's own blocks' shapes), and the fit after
that plan still swaps, trains and saves a checkpoint of the whole model (no placeholders)."""

import json

import pytest
import torch
from run_helpers import pretrained_base, refused_here, run_main_here, train_here
from torch import nn

from ldm import checkpoint
from ldm.block_swap import blocks_of
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

SWAPPED = 3


def int8_swapped_bytes(block) -> int:
    """Bytes a swap holds in host RAM of an unquantized `block` once its base is int8 (LLM.int8,
    bitsandbytes' format: each frozen Linear one byte a value and one fp32 scale a row); every
    other frozen tensor as it is."""
    frozen = [*(p for p in block.parameters() if not p.requires_grad), *block.buffers()]
    linears = [m for m in block.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    weights = {id(m.weight) for m in linears}
    other = sum(t.numel() * t.element_size() for t in frozen if id(t) not in weights)
    return other + sum(m.out_features * (m.in_features + 4) for m in linears)


# An int8 base: its run goes the whole way of a plain one (plan, swap, fit, checkpoint) and more
# (the base quantized by the plan, bitsandbytes' layers swapped); a swapped plain base is planned
# in tests/lun/test_memory_swap.py and fitted in tests/ldm/test_block_swap.py, in-process.
@pytest.mark.slow  # a one-step Lightning fit of the tiny SD
def test_main_plans_the_swapped_int8_blocks_then_trains_with_them(
    tmp_path, tiny_config, shapes_dir
):
    pytest.importorskip("bitsandbytes")
    pretrained_base(tiny_config, tmp_path / "base.ckpt")
    run = train_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            f"model.params.ckpt_path={tmp_path / 'base.ckpt'}",
            "model.base_learning_rate=1.0e-2",
            f"model.params.lora={{rank: 2, blocks_to_swap: {SWAPPED}, base_quantization: int8}}",
            "lightning.trainer.max_steps=1",
        ],
        logs=tmp_path / "logs",
        cwd=tmp_path,
    )
    configs = sorted((run / "configs").glob("*.yaml"))
    built = instantiate_from_config(to_container(merge_configs(configs))["model"])
    swapped = sum(int8_swapped_bytes(block) for block in blocks_of(built.model)[:SWAPPED])
    plan = {p["name"]: p for p in json.loads((run / "memory-plan.json").read_text())["parts"]}
    assert plan["frozen: swapped blocks"]["nbytes"] == swapped

    # The checkpoint is the whole model in its saved layout: a model built from the run's
    # configs loads it strictly (every key, every shape: no placeholder of a swapped block).
    ckpt = run / "checkpoints" / "last.ckpt"
    fresh = {k: v.clone() for k, v in built.state_dict().items()}
    checkpoint.load_weights(built, ckpt, ema=False)
    loaded = built.state_dict()
    adapters = [k for k in loaded if ".lora_B." in k]
    assert adapters and any(not torch.equal(loaded[k], fresh[k]) for k in adapters)  # trained
    frozen = [n for n, p in built.named_parameters() if not p.requires_grad]
    assert all(loaded[k].numel() == fresh[k].numel() > 0 for k in frozen)


def test_more_blocks_to_swap_than_the_backbone_has_is_one_line_before_the_run_folder(
    tmp_path, tiny_config, shapes_dir
):
    line = refused_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            "model.params.lora={rank: 2, blocks_to_swap: 99}",
        ],
        tmp_path / "logs",
        cwd=tmp_path,
    )
    depth = len(
        blocks_of(
            instantiate_from_config(to_container(merge_configs([tiny_config]))["model"]).model
        )
    )
    assert (
        f"model.params.lora.blocks_to_swap: 99 is more than the backbone's {depth} blocks" in line
    )


@pytest.mark.parametrize("devices", [1, 2])
def test_main_resolves_blocks_to_swap_auto_or_refuses_it_on_several_processes(
    tmp_path, tiny_config, shapes_dir, devices
):
    """`main.py --plan` with `blocks_to_swap: auto`: on the CPU the plan swaps nothing and says
    why; on 2 processes (only rank 0 plans) it is one line naming the key, exit 2, before the
    run folder."""
    logs = tmp_path / "logs"
    result = run_main_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            "model.params.lora={rank: 2, blocks_to_swap: auto}",
            "lightning.trainer.accelerator=cpu",
            f"lightning.trainer.devices={devices}",
            *(["lightning.trainer.strategy=ddp"] if devices > 1 else []),
            "-l",
            str(logs),
            "--plan" if devices == 1 else "-t",
        ],
        cwd=tmp_path,
    )
    if devices == 1:
        assert result.returncode == 0, result.stderr[-3000:]
        assert "blocks_to_swap auto: 0 (the run is on the CPU" in result.stdout
        return
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "model.params.lora.blocks_to_swap: auto is chosen by rank 0's plan" in line
    assert "2 processes" in line
    assert not logs.exists() or not any(logs.iterdir())
