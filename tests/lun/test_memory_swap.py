"""The launcher's memory plan of a LoRA with block swap (lun.memory.memory_plan): the swapped
blocks' frozen tensors in host RAM and off the device, their staging on the device, the probe's
peak not counted twice, the model given back unswapped, and the fewest blocks to swap offered
when the device is too small. Expected bytes come from the model's own blocks (numel x element
size of each frozen tensor), not from the plan's code."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from lora_helpers import build
from trainer_helpers import quiet_trainer

from ldm.block_swap import blocks_of
from lun.memory import DEVICE, HOST, as_the_fit_holds_it, memory_plan
from lun.memory_probe import measure_activations

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
SWAPPED = 3
BIG = 1 << 40  # a budget nothing reaches


def tiny_lora(blocks_to_swap: int = SWAPPED):
    model = build(CONFIG, f"{{rank: 2, blocks_to_swap: {blocks_to_swap}}}")
    model.strategy_casts_parameters = False  # what lun.run.check_strategy_fits sets
    return model


def batch():
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return {"image": images, "caption": ["a red circle", "a blue square"]}


def with_swap(model, count: int):
    model.lora_settings = dataclasses.replace(model.lora_settings, blocks_to_swap=count)
    return model


def block_bytes(model) -> list[list[int]]:
    """Per block of the backbone, the bytes of each frozen tensor (parameters that do not
    train, and buffers): what a swap moves to host RAM."""
    return [
        [p.numel() * p.element_size() for p in block.parameters() if not p.requires_grad]
        + [b.numel() * b.element_size() for b in block.buffers()]
        for block in blocks_of(model.model)
    ]


def parts(plan) -> dict:
    return {p.name: p for p in plan.parts}


def placeholders(model) -> int:
    return sum(t.numel() == 0 for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def model():
    return tiny_lora()


@pytest.fixture(scope="module")
def trainer():
    return quiet_trainer(max_steps=1)


def test_the_swapped_blocks_are_in_host_ram_their_staging_on_the_device(model, trainer):
    swapped = [t for block in block_bytes(model)[:SWAPPED] for t in block]
    largest = max(sum(block) for block in block_bytes(model)[:SWAPPED])
    plan = parts(memory_plan(model, trainer, activations=0, host_budget=BIG))
    plain = parts(memory_plan(with_swap(model, 0), trainer, activations=0, host_budget=BIG))
    with_swap(model, SWAPPED)
    assert plan["frozen: swapped blocks"].nbytes == sum(swapped)  # exact on the CPU
    assert plain["frozen: model"].nbytes - plan["frozen: model"].nbytes == sum(swapped)
    assert plan["block swap staging"].nbytes == 2 * largest  # two blocks resident at once
    assert "frozen: swapped blocks" not in plain and "block swap staging" not in plain


def test_a_plan_for_an_accelerator_pins_the_swapped_blocks_and_stages_on_the_device(
    model, trainer, monkeypatch
):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    blocks = block_bytes(model)[:SWAPPED]
    # torch's caching host allocator: each pinned tensor rounded up to a power of two
    pinned = sum(2 ** math.ceil(math.log2(t)) for block in blocks for t in block if t)
    plan = memory_plan(
        model, trainer, activations=0, device="cuda", device_budget=BIG, host_budget=BIG
    )
    found = parts(plan)
    assert found["frozen: swapped blocks"].place == HOST
    assert found["frozen: swapped blocks"].nbytes == pinned
    assert found["block swap staging"].place == DEVICE
    assert found["block swap staging"].nbytes == 2 * max(sum(b) for b in blocks)
    assert found["frozen: model"].place == DEVICE


def test_the_probe_peak_holds_the_streamed_blocks_once(model, trainer):
    """activations + staging is the peak of the step with the blocks swapped: the blocks the
    probe streamed in are the staging part, not activations too."""
    plan = parts(memory_plan(model, trainer, batch(), host_budget=BIG))
    with as_the_fit_holds_it(model, trainer):  # the step as the fit runs it
        assert "block_swap" in model.model.__dict__
        peak = measure_activations(model, batch(), trainer)
    assert plan["activations"].nbytes + plan["block swap staging"].nbytes == peak


def test_the_model_after_the_plan_is_the_model_before_it(trainer):
    model = tiny_lora()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory_plan(model, trainer, batch(), host_budget=BIG)
    assert "block_swap" not in model.model.__dict__ and placeholders(model) == 0
    for block in blocks_of(model.model):
        assert "forward" not in block.__dict__  # no wrapper left
        assert not block._state_dict_hooks and not block._load_state_dict_pre_hooks
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert [k for k in before if not torch.equal(after[k], before[k])] == []


def test_the_options_offer_the_fewest_blocks_to_swap_that_fit(trainer):
    """The offered N is checked against the plans themselves: swapping N blocks fits the
    budget, swapping any fewer does not (the activations fixed: the same step)."""
    model = tiny_lora(0)

    def peak(count: int) -> int:
        plan = memory_plan(
            with_swap(model, count),
            trainer,
            activations=1 << 20,
            device="cuda",
            device_budget=BIG,
            host_budget=BIG,
        )
        return plan.peak(DEVICE)

    depth = len(blocks_of(model.model))
    budget = peak(5)  # fits with 5 blocks swapped; maybe with fewer
    plan = memory_plan(
        with_swap(model, 0),
        trainer,
        activations=1 << 20,
        device="cuda",
        device_budget=budget,
        host_budget=BIG,
    )
    (option,) = [o for o in plan.options if o["name"] == "block swap"]
    count = int(option["how"].split("blocks_to_swap: ")[1].split()[0])
    assert peak(count) <= budget
    assert all(peak(fewer) > budget for fewer in range(count))
    assert plan.peak(DEVICE) - option["saves"][DEVICE] == peak(count)
    assert 0 < count < depth
    with pytest.raises(Exception, match=f"blocks_to_swap: {count} "):
        plan.check()  # the refusal names it

    with_swap(model, 0)
    small = memory_plan(
        model, trainer, activations=1 << 20, device="cuda", device_budget=1, host_budget=BIG
    )
    (option,) = [o for o in small.options if o["name"] == "block swap"]
    assert f"blocks_to_swap: {depth} (every block) is not enough alone" in option["how"]
    assert small.peak(DEVICE) - option["saves"][DEVICE] == peak(depth)


def test_a_plan_that_fits_or_runs_on_the_cpu_offers_no_swap(trainer):
    model = tiny_lora(0)
    fits = memory_plan(
        model, trainer, activations=0, device="cuda", device_budget=BIG, host_budget=BIG
    )
    on_cpu = memory_plan(model, trainer, activations=0, host_budget=1)
    assert all(o["name"] != "block swap" for o in [*fits.options, *on_cpu.options])
