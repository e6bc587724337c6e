"""The launcher's memory plan of a model the device cannot hold (lun.memory.memory_plan): the
probe step is not run where the parts held before it already exceed the device, a probe step
the device's allocator refuses makes a plan over budget (its options, not a traceback), and
`blocks_to_swap: auto` goes on from there to the blocks that fit. This is the case block swap
exists for (Flux.1-dev on a 24 GB card); without it the plan itself ran out of memory.

Plans are placed for an accelerator with a device budget the test picks (as
tests/lun/test_memory_swap.py does without CUDA); a device of that size is emulated around the
real probe: the probe measures the step, and the emulated allocator refuses it, as CUDA's does,
when the tensors it holds (the model's parameters, buffers and gradients) plus the measured
activations exceed the device."""

import dataclasses
from pathlib import Path

import pytest
import torch
from lora_helpers import build
from trainer_helpers import quiet_trainer

import lun.memory
from ldm.block_swap import blocks_of
from lun.memory import ACTIVATIONS, DEVICE, MemoryPlanError, memory_plan
from lun.memory_quant import plan_with_quantization

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
BIG = 1 << 40  # a budget nothing reaches
MiB = 1 << 20
PROBE = lun.memory.measure_activations  # the real one


def tiny_lora(settings: str = "{rank: 2, blocks_to_swap: 0}"):
    model = build(CONFIG, settings)
    model.strategy_casts_parameters = False  # what lun.run.check_strategy_fits sets
    return model


def batch():
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return {"image": images, "caption": ["a red circle"]}


def plan_for(model, budget: int, **kwargs):
    return memory_plan(
        model,
        quiet_trainer(max_steps=1),
        batch(),
        device="cuda",
        device_budget=budget,
        host_budget=BIG,
        **kwargs,
    )


def activations(plan):
    (part,) = [p for p in plan.parts if p.name == ACTIVATIONS]
    return part


def resident(model) -> int:
    """Bytes of the model's tensors and gradients: what the device holds during a probe step
    besides its activations (a swapped block holds empty placeholders)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    grads = [p for p in model.parameters() if p.requires_grad]
    return sum(t.numel() * t.element_size() for t in [*tensors, *grads])


class EmulatedDevice:
    """The real probe, on a device of `capacity` bytes: a step that needs more is refused the
    way CUDA's allocator refuses it (torch.OutOfMemoryError, "Tried to allocate X MiB")."""

    def __init__(self, monkeypatch, capacity: int):
        self.capacity, self.calls, self.refused, self.needs = capacity, 0, 0, []
        monkeypatch.setattr(lun.memory, "measure_activations", self)

    def __call__(self, model, batch, trainer):
        self.calls += 1
        measured = PROBE(model, batch, trainer)
        need = resident(model) + measured
        self.needs.append(need)
        if need > self.capacity:
            self.refused += 1
            asked = -(-(need - self.capacity) // MiB)  # whole MiB, rounded up
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {asked}.00 MiB. GPU 0 has a total "
                f"capacity of {self.capacity / 2**30:.2f} GiB of which 0 bytes is free."
            )
        return measured


def frozen_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def test_a_model_the_device_cannot_hold_is_not_moved_there_to_probe(monkeypatch):
    """Held parts over the device: no probe (it would move the whole model there), the
    activations are said to be unmeasured, and the refusal offers block swap."""
    model = tiny_lora()
    device = EmulatedDevice(monkeypatch, BIG)
    plan_for(model, BIG)
    assert device.calls == 1  # a model that fits is probed
    budget = frozen_bytes(model) // 2  # its frozen weights alone are twice the device
    plan = plan_for(model, budget)
    assert device.calls == 1
    assert activations(plan).nbytes == 0
    assert activations(plan).detail.startswith("not measured: the parts held before the step")
    with pytest.raises(MemoryPlanError, match=r"blocks_to_swap: \d+"):
        plan.check()


def test_a_refused_probe_step_is_a_plan_over_budget_with_its_options(monkeypatch):
    """The step's activations are at least what the device had left plus the allocation it
    refused; the plan is over budget and names what would make it fit."""
    model = tiny_lora()
    measured = plan_for(model, BIG)
    need = resident(model) + activations(measured).nbytes
    budget = need - 3 * MiB // 2  # the weights fit, the step does not
    assert frozen_bytes(model) < budget
    device = EmulatedDevice(monkeypatch, budget)
    plan = plan_for(model, budget)
    assert device.refused == 1
    held = sum(p.nbytes for p in plan.parts if p.place == DEVICE and p.name != ACTIVATIONS)
    held_before_the_step = held - sum(  # parts planned after the probe (none on the device here)
        p.nbytes for p in plan.parts if p.place == DEVICE and p.name in ("EMA",)
    )
    assert activations(plan).nbytes == budget - held_before_the_step + 2 * MiB
    assert activations(plan).detail == "at least: the probe step ran out of device memory"
    assert plan.peak(DEVICE) > budget
    with pytest.raises(MemoryPlanError, match=r"blocks_to_swap: \d+"):
        plan.check()


def test_on_the_cpu_a_refused_probe_step_is_still_one_line(monkeypatch):
    model = tiny_lora()
    EmulatedDevice(monkeypatch, 1)
    with pytest.raises(MemoryPlanError, match="^memory plan: out of memory in the probe step"):
        memory_plan(model, quiet_trainer(max_steps=1), batch(), host_budget=BIG)


def test_auto_swaps_from_a_refused_probe_to_the_fewest_blocks_that_fit(monkeypatch, capsys):
    """`blocks_to_swap: auto` on a device that refuses the unswapped probe step: it takes the
    fewest blocks whose plan, made on that device, fits - found here by planning each number
    of blocks on it, independently of the search."""
    model = tiny_lora()
    depth = len(blocks_of(model.model))
    device = EmulatedDevice(monkeypatch, BIG)
    unswapped = plan_for(model, BIG)
    held = sum(p.nbytes for p in unswapped.parts if p.place == DEVICE and p.name != ACTIVATIONS)
    budget = (held + device.needs[0]) // 2  # the model fits the device, its step does not
    device = EmulatedDevice(monkeypatch, budget)
    peaks = {}
    for count in range(depth + 1):  # upwards, to the first that fits
        model.lora_settings = dataclasses.replace(model.lora_settings, blocks_to_swap=count)
        peaks[count] = plan_for(model, budget).peak(DEVICE)
        if peaks[count] <= budget:
            break
    expected = count
    assert device.refused >= 1 and 0 < expected < depth
    model = tiny_lora("{rank: 2, blocks_to_swap: auto}")
    device = EmulatedDevice(monkeypatch, budget)
    plan = plan_with_quantization(
        model, quiet_trainer(max_steps=1), lambda: plan_for(model, budget)
    )
    assert device.refused >= 1  # the unswapped step did not fit the device
    assert model.lora_settings.blocks_to_swap == expected
    assert plan.peak(DEVICE) == peaks[expected]
    assert activations(plan).detail.startswith("measured by one probe step")
    plan.check()
    assert f"blocks_to_swap auto: {expected} of {depth} blocks" in capsys.readouterr().out
