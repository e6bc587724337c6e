"""The scaffolding shared by scripts/benchmark.py's backbone sections (sdxl, flux, mmdit): one
training step of our model against diffusers' holding the same weights, same inputs, same fused
AdamW (ldm.optim), fp32, the two taking turns step by step; optionally the peak memory of that
step, each side in its own process.

A section module (scripts/benchmark_<name>.py) supplies
    TITLE                      the table's first header cell
    BATCH                      images per step (for img/s)
    build_models(device, network) -> (ours, theirs), same weights, in train mode
    inputs(device, network)    a list of tensors, the regression target last
    forward(model, batch)      the prediction, the shape of the target
and calls `section(module, args, device, network)`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

SIDES = ("diffusers", "ours")


def randomise(model, scale: float = 0.02) -> None:
    """Every weight moved by noise (seed the build before): the zero-initialised (adaLN-Zero,
    output) layers would otherwise leave the blocks idle and their gradients zero."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape))


def train_step(forward, model, optimizer, batch) -> None:
    """Forward, MSE against the batch's last tensor, backward, optimizer step."""
    import torch.nn.functional as F

    F.mse_loss(forward(model, batch), batch[-1]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def output_gap(module, ours, theirs, batch) -> str:
    """The premise of the comparison: both compute the same function."""
    import torch

    with torch.no_grad():
        out = module.forward(ours, batch)
        gap = (out - module.forward(theirs, batch)).abs().max().item()
    return f"outputs, ours - diffusers: max |diff| {gap:.2e} (mean |out| {out.abs().mean():.2f})"


def saved_activations(module, ours, theirs, batch) -> str:
    """The activation memory of a step without the allocator's noise: the bytes of the distinct
    tensors autograd keeps from the forward for the backward (weights not counted)."""
    import torch

    sizes = {}
    for label, model in (("ours", ours), ("diffusers", theirs)):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = {}

        def pack(tensor, kept=kept, weights=weights):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module.forward(model, batch)
        sizes[label] = sum(kept.values())
    return (
        f"activations kept for the backward: ours {sizes['ours'] / 2**20:.0f} MiB, diffusers "
        f"{sizes['diffusers'] / 2**20:.0f} MiB ({sizes['ours'] / sizes['diffusers']:.2f}x)"
    )


def seconds_per_step(module, args, device, network, memory: bool = False) -> dict[str, float]:
    """Median seconds of a step of each side, A B B A ...; with `--cpu-seconds` on a CPU, in
    CPU seconds on one thread (a shared machine's wall clock swings several-fold). With `memory`
    it also prints both sides' activations kept for the backward."""
    import time

    import torch
    from benchmark_dit import turns_median_seconds

    from ldm.optim import build_optimizer

    cpu_seconds = getattr(args, "cpu_seconds", False) and device.type == "cpu"
    if cpu_seconds:
        torch.set_num_threads(1)  # process time is then the step's own time

    ours, theirs = module.build_models(device, network)
    batch = module.inputs(device, network)
    print(f"{module.TITLE}: {output_gap(module, ours, theirs, batch)}", flush=True)
    if memory:
        print(f"{module.TITLE}: {saved_activations(module, ours, theirs, batch)}", flush=True)
    models = {"diffusers": theirs, "ours": ours}
    steps = {}
    for label, model in models.items():  # the same optimizer on both sides: fused AdamW
        optimizer = build_optimizer(model.parameters(), lr=1e-5)
        steps[label] = lambda m=model, o=optimizer: train_step(module.forward, m, o, batch)
    clock = time.process_time if cpu_seconds else time.perf_counter
    return turns_median_seconds(steps, device, args.steps, args.warmup, clock)


def peak_memory(module_name: str, which: str, device, network) -> dict[str, int]:
    """Runs in its own process: peak memory (bytes) of one training step of one side, after a
    first step has allocated the optimizer state (RSS high-water mark on CPU, max allocated on
    CUDA), and the step's part above the memory before it."""
    import torch
    from bench_common import _proc_status

    from ldm.optim import build_optimizer

    module = importlib.import_module(module_name)
    ours, theirs = module.build_models(device, network)
    model = ours if which == "ours" else theirs
    del ours, theirs
    optimizer = build_optimizer(model.parameters(), lr=1e-5)
    batch = module.inputs(device, network)
    train_step(module.forward, model, optimizer, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        train_step(module.forward, model, optimizer, batch)
        peak = torch.cuda.max_memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM)
        before = _proc_status("VmRSS")
        train_step(module.forward, model, optimizer, batch)
        peak = _proc_status("VmHWM")
    return {"peak": peak, "step": peak - before}


def measure_memory(module_name: str, which: str, device, network) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, __file__, module_name, which, "--device", str(device)]
        + ["--network", json.dumps(network)],
        capture_output=True,
        text=True,
        check=True,
        # glibc otherwise raises its mmap threshold as large blocks are freed, keeps later ones
        # on its heap, and RSS stops falling when tensors are freed (benchmark.memory_section).
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def section(module, args, device, network, memory: bool = False) -> list[str]:
    """The markdown rows of one backbone section: img/s of each side and ours / diffusers; with
    `memory`, the peak of a step, ours / diffusers of it and of the step's part above the memory
    before it."""
    seconds = seconds_per_step(module, args, device, network, memory)
    cpu_seconds = getattr(args, "cpu_seconds", False) and device.type == "cpu"
    speed = "img/CPU-s (1 thread)" if cpu_seconds else "img/s"
    header = f"| {module.TITLE} | dtype | {speed} | vs diffusers |"
    if memory:
        peaks = {w: measure_memory(module.__name__, w, device, network) for w in SIDES}
        header += " peak memory | ours / diffusers (peak) | ours / diffusers (step) |"
    rows = [header, "|---" * header.count(" |") + "|"]
    for label in SIDES:
        row = (
            f"| {label} | fp32 | {module.BATCH / seconds[label]:.3g} | "
            f"{seconds['diffusers'] / seconds[label]:.2f}x |"
        )
        if memory:
            # The peak holds the weights, gradients and AdamW state, alike on both sides; the
            # step's own part (activations, gradients, temporaries) is where they differ.
            ratio = peaks[label]["peak"] / peaks["diffusers"]["peak"]
            step = peaks[label]["step"] / peaks["diffusers"]["step"]
            row += f" {peaks[label]['peak'] / 2**20:.0f} MiB | {ratio:.2f}x | {step:.2f}x |"
        rows.append(row)
        print(row, flush=True)
    return rows


def child_main(argv=None) -> None:
    """The memory child: one side's peak of one step, printed as JSON."""
    import argparse

    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        description="peak memory of one backbone training step (benchmark.py runs this)",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("module", help="a section module, e.g. benchmark_mmdit")
    parser.add_argument("side", choices=SIDES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--network", default="{}", help="the module's network arguments, JSON")
    args = parser.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    network = json.loads(args.network)
    print(json.dumps(peak_memory(args.module, args.side, torch.device(args.device), network)))


if __name__ == "__main__":
    child_main()
