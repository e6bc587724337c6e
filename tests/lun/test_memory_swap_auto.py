"""`model.params.lora.blocks_to_swap: auto`, resolved by the launcher's memory plan
(lun.memory_quant.plan_with_quantization): the fewest blocks whose re-plan fits the device, the
format / swap order of `choose` with `base_quantization: auto` too, the printed line, the setting
the fit then follows. Plans are placed for an accelerator with a device budget the test picks
(as tests/lun/test_memory_swap.py does without CUDA); the expected choice is found by planning
models with each fixed setting, independently of the search."""

import dataclasses
from pathlib import Path

import pytest
import torch
from lora_helpers import build
from trainer_helpers import quiet_trainer

from ldm import quantize
from ldm.block_swap import blocks_of, swaps_in
from ldm.lora.settings import parse_settings
from lun.memory import DEVICE, MemoryPlanError, memory_plan
from lun.memory_parts import _gib
from lun.memory_quant import plan_with_quantization

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
BIG = 1 << 40  # a budget nothing reaches
# `lun.memory_quant.choose`'s order, as its docstring states it: each format unswapped, then
# fp8, int8 and nf4 with the fewest blocks swapped
FORMATS, SWAPPABLE = ("none", "fp8", "int8", "nf4"), ("fp8", "int8", "nf4")


def tiny_lora(settings: str):
    model = build(CONFIG, settings)
    model.strategy_casts_parameters = False  # what lun.run.check_strategy_fits sets
    return model


def accelerator_plan(model, budget: int):
    """The plan for an accelerator of `budget` bytes, the model as its settings say, the
    activations fixed (the same step whatever is swapped)."""
    return memory_plan(
        model,
        quiet_trainer(max_steps=1),
        activations=1 << 20,
        device="cuda",
        device_budget=budget,
        host_budget=BIG,
    )


def peak_with(model, count: int) -> int:
    model.lora_settings = dataclasses.replace(model.lora_settings, blocks_to_swap=count)
    return accelerator_plan(model, BIG).peak(DEVICE)


def resolve(settings: str, budget: int, trainer=None):
    model = tiny_lora(settings)
    trainer = trainer or quiet_trainer(max_steps=1)
    plan = plan_with_quantization(model, trainer, lambda: accelerator_plan(model, budget))
    return model, plan


def swapped_by_the_fit(model) -> int:
    """How many blocks the fit-start preparation (what the fit's setup runs) swaps."""
    model.training_mode.on_fit_start(model, quiet_trainer(max_steps=1), False)
    try:
        return sum(len(s.host_tensors()) for s in swaps_in(model))
    finally:
        model.training_mode.on_fit_end(model)


@pytest.fixture(scope="module")
def peaks():
    """The device peak of the unquantized tiny LoRA with each number of blocks swapped."""
    model = tiny_lora("{rank: 2}")
    return [peak_with(model, n) for n in range(len(blocks_of(model.model)) + 1)]


@pytest.mark.parametrize("fits_with", [5, 7])
def test_auto_swaps_the_fewest_blocks_whose_replan_fits(peaks, fits_with, capsys):
    budget = peaks[fits_with]
    expected = min(n for n, peak in enumerate(peaks) if peak <= budget)
    assert expected > 0 and all(peak > budget for peak in peaks[:expected])  # N-1 does not fit
    model, plan = resolve("{rank: 2, blocks_to_swap: auto}", budget)
    assert model.lora_settings.blocks_to_swap == expected
    assert plan.peak(DEVICE) == peaks[expected]  # the plan that comes back is the swapped one
    plan.check()  # fits: no refusal
    line = capsys.readouterr().out.strip().splitlines()[-1]
    depth = len(peaks) - 1
    assert line == (
        f"blocks_to_swap auto: {expected} of {depth} blocks, "
        f"{_gib(peaks[expected])} of {_gib(budget)}"
    )
    assert swapped_by_the_fit(model) == expected  # the fit follows the choice


def test_an_int8_base_swaps_the_fewest_blocks_whose_replan_fits():
    """`base_quantization: int8` with `blocks_to_swap: auto`: the int8 model planned with each
    number of blocks swapped, the fewest that fit the budget taken, and the fit swaps them."""
    pytest.importorskip("bitsandbytes")
    model = tiny_lora("{rank: 2, base_quantization: int8}")
    peaks = [peak_with(model, n) for n in range(7)]
    budget = peaks[6]  # (the first blocks' staging outweighs what swapping them saves)
    expected = min(n for n, peak in enumerate(peaks) if peak <= budget)
    assert expected > 0
    model, plan = resolve("{rank: 2, base_quantization: int8, blocks_to_swap: auto}", budget)
    chosen = (model.lora_settings.base_quantization, model.lora_settings.blocks_to_swap)
    assert chosen == ("int8", expected)
    assert plan.peak(DEVICE) == peaks[expected]
    assert swapped_by_the_fit(model) == expected


def test_a_replan_over_budget_after_all_tries_the_next_number(peaks, capsys):
    """The probe of the swapped model may measure more than the unswapped plan's estimate
    assumed: here the step with 5 blocks swapped takes 1 MiB more activations (a figure the
    plan is given, as its probe would measure it), so 5 no longer fits and 6 is taken."""
    budget, extra = peaks[5], 1 << 20
    replans = [peak + (extra if n == 5 else 0) for n, peak in enumerate(peaks)]
    expected = min(n for n, peak in enumerate(replans) if peak <= budget)
    assert expected == 6  # the case this test is about: the search's first answer fails
    model = tiny_lora("{rank: 2, blocks_to_swap: auto}")

    def make_plan():
        count = model.lora_settings.blocks_to_swap
        return memory_plan(
            model,
            quiet_trainer(max_steps=1),
            activations=(1 << 20) + (extra if count == 5 else 0),
            device="cuda",
            device_budget=budget,
            host_budget=BIG,
        )

    plan = plan_with_quantization(model, quiet_trainer(max_steps=1), make_plan)
    assert model.lora_settings.blocks_to_swap == expected
    assert plan.peak(DEVICE) == replans[expected]


def test_auto_swaps_nothing_where_the_plan_fits_or_runs_on_the_cpu(peaks, capsys):
    model, plan = resolve("{rank: 2, blocks_to_swap: auto}", peaks[0])
    assert model.lora_settings.blocks_to_swap == 0 and plan.peak(DEVICE) == peaks[0]
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(
            f"blocks_to_swap auto: 0 of {len(peaks) - 1} "
            f"blocks, {_gib(peaks[0])} of {_gib(peaks[0])}"
        )
    )
    model = tiny_lora("{rank: 2, blocks_to_swap: auto}")
    trainer = quiet_trainer(max_steps=1)
    plan_with_quantization(
        model, trainer, lambda: memory_plan(model, trainer, activations=0, host_budget=BIG)
    )
    assert model.lora_settings.blocks_to_swap == 0
    assert "blocks_to_swap auto: 0 (the run is on the CPU" in capsys.readouterr().out


def test_where_no_number_of_blocks_fits_the_plan_is_refused_with_the_options(peaks):
    model, plan = resolve("{rank: 2, blocks_to_swap: auto}", min(peaks) - 1)
    assert model.lora_settings.blocks_to_swap == 0
    with pytest.raises(MemoryPlanError, match="every block"):
        plan.check()


def test_both_autos_follow_the_order_of_choose():
    """Each (format, blocks) of `choose`'s order planned on its own model, in that order, until
    one fits; two budgets: one a format fits unswapped, one only fp8 with blocks swapped fits.
    (nf4 + swap is not reachable on this tiny UNet: with layers this small bitsandbytes' maps
    per layer and its unquantized convolutions plan nf4 above fp8 at every N.)"""
    runs = [k for k in FORMATS if not quantize.unsupported(k, torch.device("cpu"))]
    models, peaks = {}, {}

    def peak(kind: str, count: int) -> int:
        if kind not in models:
            models[kind] = tiny_lora(f"{{rank: 2, base_quantization: {kind}}}")
        if (kind, count) not in peaks:
            peaks[kind, count] = peak_with(models[kind], count)
        return peaks[kind, count]

    depth = len(blocks_of(tiny_lora("{rank: 2}").model))
    order = [(k, 0) for k in runs] + [
        (k, n) for k in SWAPPABLE if k in runs for n in range(1, depth + 1)
    ]
    unswapped = min(peak(k, 0) for k in runs)
    seen = []
    for budget in (peak("none", 0) - 1, unswapped - 1):
        expected = next((k, n) for k, n in order if peak(k, n) <= budget)
        model, plan = resolve("{rank: 2, base_quantization: auto, blocks_to_swap: auto}", budget)
        chosen = (model.lora_settings.base_quantization, model.lora_settings.blocks_to_swap)
        assert chosen == expected, f"budget {budget}: {chosen} instead of {expected}"
        assert plan.peak(DEVICE) == peak(*expected)
        seen.append(expected)
    assert seen[0] == ("fp8", 0) and seen[1][0] == "fp8" and seen[1][1] > 0  # the cases asked for


@pytest.mark.parametrize("value", ["Auto", -1, 1.5, True, "3"])
def test_blocks_to_swap_takes_a_whole_number_or_auto(value):
    assert parse_settings({"blocks_to_swap": "auto"}).blocks_to_swap == "auto"
    assert parse_settings({"blocks_to_swap": 4}).blocks_to_swap == 4
    with pytest.raises(ValueError, match=r"^model.params.lora.blocks_to_swap: .* or auto, got"):
        parse_settings({"blocks_to_swap": value})


def test_auto_on_several_processes_is_one_line_naming_the_key():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert trainer.world_size == 2
    with pytest.raises(MemoryPlanError) as refused:
        resolve("{rank: 2, blocks_to_swap: auto}", BIG, trainer)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("model.params.lora.blocks_to_swap: auto is chosen by rank 0's plan")
    assert "2 processes" in line


def test_a_fit_without_the_plan_swaps_nothing_for_an_unresolved_auto():
    """A bare Lightning Trainer (no main.py, no plan): `auto` stays unresolved and the fit
    swaps no block, as documented in LoraSettings; it trains."""
    from torch.utils.data import DataLoader

    model = tiny_lora("{rank: 2, blocks_to_swap: auto}")
    seen = []

    import lightning.pytorch as pl

    class Swaps(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(len(swaps_in(pl_module)))

    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    data = [{"image": image, "caption": "a red circle"} for image in images]
    quiet_trainer(max_steps=1, callbacks=[Swaps()]).fit(model, DataLoader(data, batch_size=2))
    assert seen == [0] and model.lora_settings.blocks_to_swap == "auto"
