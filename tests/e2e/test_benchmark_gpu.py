"""scripts/benchmark_gpu.py (the GPU table of issue 30) and the demo's device choice.

The benchmark only means something on a GPU; here its arithmetic (MFU against the card's data
sheet peak), its budget and time limits, and a `--tiny` run of every row on the CPU are checked.
"""

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import yaml
from run_helpers import ROOT

from lun.config import merge_configs


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_gpu")


@pytest.fixture(scope="module")
def demo():
    return load_script("demo")


def test_card_peaks_are_the_data_sheets(bench):
    # NVIDIA H100 data sheet, BF16 tensor core (dense = half the "with sparsity" figure):
    # SXM 1,979 / 2, PCIe 1,513 / 2; A100: 312 dense. The names as torch reports them.
    assert bench.card_peak("NVIDIA H100 80GB HBM3") == 1979e12 / 2
    assert bench.card_peak("NVIDIA H100 PCIe") == pytest.approx(1513e12 / 2, rel=1e-3)
    assert bench.card_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bench.card_peak("Some Future GPU") is None


def test_mfu_is_model_flops_over_the_peak_and_absent_for_an_unknown_card(bench):
    # Issue 30's figure: 2.47 TFLOP/img at 80.6 img/s on an H100 SXM is 20 % MFU.
    peak = bench.card_peak("NVIDIA H100 80GB HBM3")
    assert bench.mfu(2.47e12, 80.6, peak) == pytest.approx(2.47e12 * 80.6 / 989.5e12)
    assert round(bench.mfu(2.47e12, 80.6, peak), 2) == 0.20
    assert bench.mfu(2.47e12, 80.6, None) is None


def test_a_row_that_does_not_fit_the_budget_is_skipped_and_recorded(bench, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    started = time.monotonic()
    bench.main(["--budget-s", "5", "--only", "model", "e2e", "--out", str(out)])
    assert time.monotonic() - started < 30  # nothing was run
    result = json.loads(out.read_text())
    assert result["skipped"] == ["model", "e2e"] and result["rows"] == []
    assert "model: skipped" in capsys.readouterr().out


def test_a_command_past_its_time_limit_is_killed_with_what_it_started(bench):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 2 s"):
        bench.python([sys.executable, "-c", code], timeout=2, new_session=True)
    assert time.monotonic() - started < 20


def test_a_command_whose_output_cannot_be_read_is_killed_not_left_running(bench):
    """A row whose line the driver fails on (its JSON, the file it rewrites) must not go on
    holding the device while the next row starts."""
    import os

    code = "import os, time; print(os.getpid(), flush=True); print('ROW {', flush=True); time.sleep(60)"
    pids = []

    def read(line):
        if line.startswith("ROW "):
            json.loads(line[4:])
        pids.append(int(line))

    with pytest.raises(json.JSONDecodeError):
        bench.python([sys.executable, "-c", code], timeout=30, on_line=read, new_session=True)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_a_peak_starts_after_the_last_rows_cycles_are_collected():
    """The blocks of a model under block swap are a reference cycle (their forwards hold the
    swap, which holds them): left to the cycle collector, the blocks loaded on the device would
    count in the next row's peak."""
    import gc
    import weakref

    import torch
    from gpu_bench.measure import reset_peak

    from ldm.block_swap import blocks_of, swap_blocks
    from ldm.dit import DiT

    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2)
    swap_blocks(model.requires_grad_(False), 2, torch.device("cpu"))
    alive = weakref.ref(blocks_of(model)[0])
    gc.disable()  # as when no collection happens to run between two rows
    try:
        del model
        assert alive() is not None  # only the cycle collector frees them
        reset_peak(torch.device("cpu"))
        assert alive() is None
    finally:
        gc.enable()


def test_a_family_setting_that_fails_leaves_the_others_their_rows(tmp_path):
    """The MMDiT / Flux rows time each side at several settings: one failing (out of memory on
    the card; here a latent past the tiny model's position table) is its rows' error, and the
    settings that ran keep their figures."""
    import benchmark_mmdit
    import torch
    from gpu_bench.families import MMDIT_TINY, against_diffusers
    from gpu_bench.measure import size

    rows = []
    settings = [(2, 8, 8), (1, 64, 8)]  # the second: 32 x 32 patches, the table holds 16 x 16
    cpu = torch.device("cpu")
    against_diffusers(
        "mmdit", benchmark_mmdit, MMDIT_TINY, settings, "tiny", None, size(True), cpu, rows.append
    )
    ran, failed = rows[:2], rows[2:]
    assert [r["row"] for r in rows] == [
        "mmdit: ours, tiny, 64 px batch 2",
        "mmdit: diffusers, 64 px batch 2",
        "mmdit: ours, tiny, 512 px batch 1",
        "mmdit: diffusers, 512 px batch 1",
    ]
    assert all(r["img_s"] > 0 and "error" not in r for r in ran) and ran[0]["vs_diffusers"] > 0
    assert all("position" in r["error"] or "pos_embed" in r["error"] for r in failed)
    assert failed[0]["vs_diffusers"] is None and "img_s" not in failed[0]


@pytest.fixture(scope="module")
def driven_rows(tmp_path_factory):
    """`benchmark_gpu.py --tiny` of the model, compile and main.py rows, started in the
    background by the first test that asks: each row group runs in a process of its own, as on
    the GPU (torch.compile's caches stay out of this one), on one core while the in-process
    rows of the tests run beside it on the other. (process, its --out file, its output)"""
    folder = tmp_path_factory.mktemp("benchmark_gpu")
    out, log = folder / "tiny.json", folder / "driver.log"
    rows = ["model", "compile", "e2e_no_ema"]
    cmd = [sys.executable, "scripts/benchmark_gpu.py", "--tiny", "--out", str(out), "--only", *rows]
    with log.open("w") as output:
        driver = subprocess.Popen(cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    yield driver, out, log
    driver.wait()  # a test that failed first leaves no row group running


@pytest.mark.slow  # four tiny models against diffusers / the plan, pytest, one main.py run (~40 s)
def test_tiny_runs_the_family_rows_on_the_cpu(bench, tmp_path, driven_rows):
    """The rows of issues 33 and 34 (scripts/gpu_bench/families.py), as registered in ROWS, at
    tiny width on the CPU - called in this process (the driver's own process per group is run
    by `driven_rows`, which runs beside this test): a start-up of torch and diffusers per group
    fewer."""
    import argparse

    import torch
    from gpu_bench.measure import size

    args = argparse.Namespace(tiny=True, work=str(tmp_path), row_timeout=600)
    rows = {}
    for name in ("mmdit", "flux", "flux_plan", "plan_auto", "ema_test"):
        bench.ROWS[name][0](
            args, size(True), torch.device("cpu"), lambda r: rows.update({r["row"]: r})
        )
    errors = {name: row["error"] for name, row in rows.items() if "error" in row}
    assert not errors, errors
    check_family_rows(rows)


def check_family_rows(rows: dict) -> None:
    from gpu_bench.families import FLUX_RANK, FLUX_TINY

    from lun.memory_parts import HOST, GiB
    from lun.memory_quant import counts_plan, flux_dev

    # MMDiT and Flux against diffusers: both sides hold the same weights (their fp32 outputs
    # agree), both were timed
    for family in ("mmdit", "flux"):
        ours = next(row for name, row in rows.items() if name.startswith(f"{family}: ours"))
        assert ours["mean_abs_out"] > 0 and ours["max_out_diff"] < 1e-5 * max(
            1.0, ours["mean_abs_out"]
        )
        assert ours["img_s"] > 0 and ours["vs_diffusers"] > 0
        theirs = [row for name, row in rows.items() if name.startswith(f"{family}: diffusers")]
        assert len(theirs) == 1 and theirs[0]["img_s"] > 0

    # Flux plan against the measured peak: the plan is lun.memory_quant's for these settings,
    # the measurement the tensors the step really held. Between steps the run holds what the
    # plan holds less the step's parts; with block swap at most the staging more (the swapped
    # blocks left resident after the step).
    flux = [row for name, row in rows.items() if name.startswith("flux plan:")]
    assert [row["row"].split(", ")[-1] for row in flux] == [
        "fp8 base",
        f"nf4 base + {FLUX_TINY['swap']} blocks swapped",
    ]
    for row, (kind, swap) in zip(flux, [("fp8", 0), ("nf4", FLUX_TINY["swap"])], strict=True):
        counts = flux_dev(FLUX_TINY["hidden"], FLUX_TINY["double"], FLUX_TINY["single"])
        plan = counts_plan(
            counts,
            kind,
            rank=FLUX_RANK,
            pixels=FLUX_TINY["pixels"],
            blocks_to_swap=swap,
            text_tokens=FLUX_TINY["text_tokens"],
            device="cpu",
        )
        assert row["plan_gib"] == pytest.approx(plan.peak(HOST) / GiB)
        assert row["plan_vs_measured"] == pytest.approx(row["plan_gib"] / row["measured_gib"])
        assert row["measured_gib"] == pytest.approx(row["held_gib"] + row["step_gib"])
        held, plan_held, staging = row["held_gib"], row["plan_held_gib"], row["plan_staging_gib"]
        assert (staging > 0) == (swap > 0)
        assert plan_held * 0.99 <= held <= (plan_held + staging) * 1.01, row
        assert 0.5 < row["plan_vs_measured"] < 1.5, row  # activations: an estimate

    # main.py with blocks_to_swap auto (on the CPU: nothing to swap, and it says why) trained
    auto = next(row for name, row in rows.items() if name.startswith("plan auto:"))
    assert auto["blocks_to_swap"] == 0 and "the run is on the CPU" in auto["choice"]
    assert auto["steps"] == 3 and auto["plan_gib"] > 0
    assert auto["card_gib"] is None and auto["measured_gib"] is None  # no card on a CPU

    # the EMA's device test ran under pytest: skipped on a CPU, not failed
    ema = next(row for name, row in rows.items() if name.startswith("ema test"))
    assert (ema["passed"], ema["failed"], ema["skipped"]) == (0, 0, 1), ema


@pytest.mark.slow  # the model, compile and sampling rows and one main.py run (~40 s on 2 cores)
def test_tiny_runs_the_rows_on_the_cpu(bench, driven_rows, tmp_path):
    """`--tiny` rows at tiny width on the CPU: the model step against diffusers, compile,
    sampling, main.py end to end through the row's timer callback, and block swap. (The cached
    and EMA main.py rows and the demo, ~4 more minutes, run with `--tiny` alone; the launcher,
    the cache and the demo have their own tests.) The driver's rows are `driven_rows`'; the
    sampling and swap rows are called here, beside it, as the family test calls its rows."""
    import argparse

    import torch
    from gpu_bench.measure import size

    args = argparse.Namespace(tiny=True, work=str(tmp_path), row_timeout=600)
    here = []
    for name in ("sampling", "swap"):
        bench.ROWS[name][0](args, size(True), torch.device("cpu"), here.append)
    driver, out, log = driven_rows
    assert driver.wait() == 0, log.read_text()[-3000:]
    printed = log.read_text()
    rows = {row["row"]: row for row in json.loads(out.read_text())["rows"] + here}
    errors = {name: row["error"] for name, row in rows.items() if "error" in row}
    assert not errors, errors
    for name in (
        "model: ours",
        "model: diffusers",
        "model: ours + channels_last",
        "model: ours + torch.compile",
        "e2e: main.py online, no EMA",
    ):
        assert rows[name]["img_s"] > 0, name
    assert rows["model: ours"]["tflop_per_img"] > 0
    assert any(name.startswith("sampling") for name in rows)
    # block swap on the CPU: plain copies, the same kernels - the swapped step is the plain one
    swaps = [row for name, row in rows.items() if name.startswith("swap:")]
    assert [row["row"].split(", ")[-1] for row in swaps] == [
        "none base",
        "fp8 base",
        "int8 base",
        "nf4 base",
    ]
    for row in swaps:
        assert row["same_grads"] and row["max_out_diff"] == 0 and row["max_grad_diff"] == 0
    assert "| row | img/s | vs diffusers |" in printed


def test_the_demo_config_pins_no_device(demo):
    trainer = yaml.safe_load(demo.CONFIG.read_text())["lightning"]["trainer"]
    assert "accelerator" not in trainer and "precision" not in trainer


def test_the_demo_trains_on_a_gpu_in_bf16_when_there_is_one(demo, monkeypatch):
    import torch

    for available, accelerator, precision in ((True, "gpu", "bf16-mixed"), (False, "cpu", "32")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        overrides = demo.device_overrides(demo.cuda_available())
        trainer = merge_configs([demo.CONFIG], overrides).lightning.trainer
        assert (trainer.accelerator, str(trainer.precision)) == (accelerator, precision)


def test_the_loop_row_reads_the_figures_of_benchmark_loops_table():
    """The GPU run's loop row holds numbers, not benchmark_loop.py's printed table: each figure
    read from the table as benchmark_loop prints it, the overhead of the loop with its sign."""
    from benchmark_loop import format_loop_table
    from gpu_bench.runs import loop_figures

    wall = {"plain": 12.25, "same": 13.5, "main": 12.75}
    cpu = {"plain": 20.0, "same": 21.0, "main": 22.5}
    table = format_loop_table("loop", wall, cpu, [1.5, -0.5], "NaN/inf check", [25, 50], 25)
    figures = loop_figures("progress lines first\n" + "\n".join(table))
    assert figures == {
        "plain_ms": 12.2,  # printed to one decimal (round half to even)
        "plain_cpu_ms": 20.0,
        "main_ms": 12.8,
        "main_cpu_ms": 22.5,
        "overhead_ms": -0.8,  # main - same: wall 12.75 - 13.5
        "overhead_cpu_ms": 1.5,
        "host_read_steps": "[25, 50]",
    }


def test_the_plan_auto_row_reads_the_device_column_of_mains_plan_table():
    """The row sizes the emulated card from `main.py --plan`'s table: the device's column (the
    first on a GPU; host RAM beside it), each figure as the table rounds it."""
    from gpu_bench.families import plan_figure

    from lun.memory_parts import ACTIVATIONS, DEVICE, HOST, GiB, MemoryPlan, Part

    parts = [
        Part("frozen: model", int(1.5 * GiB), DEVICE, "fp8"),
        Part("frozen: cond_stage_model", 300 * 2**20, DEVICE, "bf16"),
        Part(ACTIVATIONS, int(2.25 * GiB), DEVICE, "measured"),
        Part("EMA", 7 * GiB, HOST, "host RAM"),
    ]
    table = MemoryPlan(parts, "cuda:0", device_budget=24 * GiB, host_budget=64 * GiB).table()
    assert plan_figure(table, "frozen: model") == int(1.5 * GiB)
    assert plan_figure(table, "frozen: cond_stage_model") == 300 * 2**20
    # training: 1.5 GiB + 300 MiB + 2.25 GiB on the device (the EMA's 7 GiB is the host's)
    assert plan_figure(table, "= training peak") == pytest.approx(4.04 * GiB, abs=0.006 * GiB)
