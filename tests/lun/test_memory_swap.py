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
from lun.memory import DEVICE, HOST, MemoryPlanError, as_the_fit_holds_it, memory_plan
from lun.memory_probe import measure_activations

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
SWAPPED = 3
BIG = 1 << 40  # a budget nothing reaches


def tiny_lora(blocks_to_swap: int = SWAPPED):
    model = build(CONFIG, f"{{rank: 2, blocks_to_swap: {blocks_to_swap}}}")
    model.strategy_casts_parameters = False  # what lun.run.check_strategy_fits sets
    return model


def batch():
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return {"image": images, "caption": ["a red circle"]}


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


def device_plan(model, count: int, budget: int = BIG):
    """The plan for an accelerator with `count` blocks swapped, the activations fixed (the same
    step whatever is swapped: what the option's estimate assumes)."""
    return memory_plan(
        with_swap(model, count),
        trainer=quiet_trainer(max_steps=1),
        activations=1 << 20,
        device="cuda",
        device_budget=budget,
        host_budget=BIG,
    )


def offered(plan) -> tuple[int, int]:
    (option,) = [o for o in plan.options if o["name"] == "block swap"]
    return int(option["how"].split("blocks_to_swap: ")[1].split()[0]), option["saves"][DEVICE]


@pytest.mark.parametrize("now, fits_with", [(0, 6), (4, 5)])
def test_the_options_offer_the_fewest_blocks_to_swap_that_fit(now, fits_with):
    """The offered N is checked against the plans themselves: with N blocks swapped the plan
    fits the budget, with any number from those swapped now up to N it does not (the tiny
    UNet's peaks are not monotone in N: its first block is larger than its second)."""
    model = tiny_lora(0)
    peaks = {n: device_plan(model, n).peak(DEVICE) for n in range(len(blocks_of(model.model)) + 1)}
    budget = peaks[fits_with]
    plan = device_plan(model, now, budget)
    count, saves = offered(plan)
    assert now < count and peaks[count] <= budget
    assert all(peaks[fewer] > budget for fewer in range(now, count))
    assert plan.peak(DEVICE) - saves == peaks[count]
    with pytest.raises(MemoryPlanError, match=f"blocks_to_swap: {count} "):
        plan.check()  # the refusal names it


def test_where_no_number_of_blocks_fits_the_option_says_so():
    model = tiny_lora(0)
    depth = len(blocks_of(model.model))
    plan = device_plan(model, 0, budget=1)
    (option,) = [o for o in plan.options if o["name"] == "block swap"]
    assert f"blocks_to_swap: {depth} (every block) is not enough alone" in option["how"]
    assert plan.peak(DEVICE) - option["saves"][DEVICE] == device_plan(model, depth).peak(DEVICE)


def test_a_plan_that_fits_or_runs_on_the_cpu_offers_no_swap(trainer):
    model = tiny_lora(0)
    fits = memory_plan(
        model, trainer, activations=0, device="cuda", device_budget=BIG, host_budget=BIG
    )
    on_cpu = memory_plan(model, trainer, activations=0, host_budget=1)
    assert all(o["name"] != "block swap" for o in [*fits.options, *on_cpu.options])


def test_under_bf16_the_plan_holds_the_base_in_bf16_once_and_the_fit_finds_it_done():
    """The fit-start preparation before the plan is the fit's own, done once: the frozen layers
    in bf16 with one input cast each, and the fit's second call changes nothing."""
    model = tiny_lora()
    trainer = quiet_trainer(max_steps=1, precision="bf16-mixed")
    plan = parts(memory_plan(model, trainer, activations=0, host_budget=BIG))
    assert "bf16" in plan["frozen: model"].detail  # counted as the fit holds it

    def held():
        return {
            name: (m.weight.dtype, len(m._forward_pre_hooks))
            for name, m in model.model.named_modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
        }

    after_plan = held()
    assert after_plan and set(after_plan.values()) == {(torch.bfloat16, 1)}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.training_mode.on_fit_start(model, trainer, False)  # what the fit's setup does
    model.training_mode.on_fit_end(model)
    assert held() == after_plan
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_an_nf4_base_keeps_its_quantization_state_on_the_device_when_swapped():
    """bitsandbytes' nf4 state is an attribute of the weight, not a tensor the swap moves: the
    plan counts all of it on the device, swapped blocks' too, and only the packed weights go
    to host RAM."""
    pytest.importorskip("bitsandbytes")
    model = build(CONFIG, f"{{rank: 2, blocks_to_swap: {SWAPPED}, base_quantization: nf4}}")
    model.strategy_casts_parameters = False
    trainer = quiet_trainer(max_steps=1)

    def plan(count):
        return parts(
            memory_plan(
                with_swap(model, count),
                trainer,
                activations=0,
                device="cuda",
                device_budget=BIG,
                host_budget=BIG,
            )
        )

    swapped, plain = plan(SWAPPED), plan(0)
    state = [
        t
        for m in model.modules()
        if hasattr(getattr(m, "weight", None), "quant_state")
        for t in (m.weight.quant_state.absmax, m.weight.quant_state.code)
    ]
    assert swapped["frozen: quantization state"].place == DEVICE
    assert (
        swapped["frozen: quantization state"].nbytes == plain["frozen: quantization state"].nbytes
    )
    assert (
        plain["frozen: quantization state"].nbytes
        >= sum(t.numel() * t.element_size() for t in state)
        > 0
    )
    packed = [t for block in block_bytes(model)[:SWAPPED] for t in block]
    assert plain["frozen: model"].nbytes - swapped["frozen: model"].nbytes == sum(packed)


def test_an_int8_base_swaps_its_rows_and_scales_and_keeps_nothing_on_the_device():
    """An int8 base (LLM.int8, bitsandbytes' format: one byte a value, one fp32 scale a row)
    with blocks swapped: the plan holds in host RAM each swapped Linear's rows and scales (from
    the layers' shapes) and the blocks' other frozen tensors, off the device by as much, and no
    bitsandbytes state of its own anywhere."""
    pytest.importorskip("bitsandbytes")
    model = build(CONFIG, f"{{rank: 2, blocks_to_swap: {SWAPPED}, base_quantization: int8}}")
    model.strategy_casts_parameters = False
    trainer = quiet_trainer(max_steps=1)

    def plan(count):
        return parts(memory_plan(with_swap(model, count), trainer, activations=0, host_budget=BIG))

    swapped, plain = plan(SWAPPED), plan(0)
    expected, layers = 0, 0
    for block in blocks_of(model.model)[:SWAPPED]:
        int8 = [m for m in block.modules() if type(m).__name__ == "Linear8bitLt"]
        layers += len(int8)
        rows = sum(m.out_features * m.in_features + 4 * m.out_features for m in int8)
        quantized = {id(t) for m in int8 for t in (m.weight, m.row_scales)}
        frozen = [p for p in block.parameters() if not p.requires_grad] + list(block.buffers())
        other = [t for t in frozen if id(t) not in quantized]
        expected += rows + sum(t.numel() * t.element_size() for t in other)
    assert layers > 0 and swapped["frozen: swapped blocks"].nbytes == expected
    assert plain["frozen: model"].nbytes - swapped["frozen: model"].nbytes == expected
    assert "frozen: quantization state" not in swapped
