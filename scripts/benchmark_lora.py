"""scripts/benchmark.py's lora section: a LoRA training step of ours against diffusers + peft."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import (
    BATCH,
    DTYPES,
    UNET_PARAMS,
    _proc_status,
    build_unets,
    cpu_has_bf16,
    inputs,
    original_config,
    synchronize,
    train_step,
)

# --- LoRA: ours (LatentDiffusion + ldm.lora) against diffusers + peft ---------------------------
LORA_RANK = 16
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # diffusers' train_text_to_image_lora.py


def build_lora_unets(device, dtype=None):
    """The same base UNet with rank-16 LoRA on the attention projections (gaussian init), ours as
    a LoRA run builds it (`ldm.lora.add_adapters`, the frozen base held in `dtype` as under
    `base_dtype: auto`), diffusers' as train_text_to_image_lora.py does: `unet.add_adapter(
    LoraConfig(...))`, the frozen UNet cast to the mixed-precision dtype, the adapters float32."""
    import torch
    from peft import LoraConfig

    from ldm import lora
    from ldm.util import instantiate_from_config

    dtype = dtype or torch.float32
    ours, theirs = build_unets(torch.device("cpu"), trained_like=True)
    model = instantiate_from_config(original_config(UNET_PARAMS)["model"])
    model.denoiser.load_state_dict(ours.state_dict())
    settings = {"rank": LORA_RANK, "alpha": LORA_RANK, "targets": ["attn"], "init": "gaussian"}
    lora.add_adapters(model, lora.parse_settings(settings))
    if dtype != torch.float32:
        lora.hold_frozen_in(model.model, dtype)
    backbone = model.denoiser
    del model, ours  # the VAE and text encoder go: only the UNets are compared

    theirs.requires_grad_(False)
    theirs.to(dtype)
    theirs.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS,
        )
    )
    for param in theirs.parameters():  # diffusers' cast_training_params
        if param.requires_grad:
            param.data = param.data.float()
    return backbone.to(device).train(), theirs.to(device).train()


def lora_optimizer(model) -> torch.optim.Optimizer:
    """The same for both sides: ours (fused AdamW) over the trainable (adapter) weights."""
    from ldm.optim import build_optimizer

    return build_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def lora_memory_child(which: str, device) -> None:
    """Its own process: peak memory of one LoRA training step (fp32), as `memory_child`."""
    import torch

    ours, theirs = build_lora_unets(device)
    model = ours if which == "ours" else theirs
    del ours, theirs
    optimizer = lora_optimizer(model)
    batch = inputs(device)
    train_step(model, optimizer, batch, torch.float32)  # allocates the optimizer state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optimizer, batch, torch.float32)
        peak = torch.cuda.max_memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        train_step(model, optimizer, batch, torch.float32)
        peak = _proc_status("VmHWM")
    print(json.dumps({"peak": peak}))


def paired_seconds(steps: dict, device, repeats, warmup) -> dict:
    """Seconds of each step of the two callables, run in pairs whose order alternates (on a
    shared machine the load swings within a run; a pair shares it, and neither always goes
    first). Returns every timed step, pair by pair."""
    times = {label: [] for label in steps}
    order = list(steps)
    for repeat in range(warmup + repeats):
        for label in order if repeat % 2 == 0 else order[::-1]:
            synchronize(device)
            start = time.perf_counter()
            steps[label]()
            synchronize(device)
            if repeat >= warmup:
                times[label].append(time.perf_counter() - start)
    return times


def lora_section(args, device) -> list[str]:
    rows = [
        f"| LoRA train step (rank {LORA_RANK}, attn; batch 4, 32x32, ch 128) | dtype | img/s "
        "| speed vs diffusers+peft (median of pairs, range) | peak memory | memory vs diffusers+peft |",
        "|---|---|---|---|---|---|",
    ]
    peaks = {}
    for which in ("diffusers", "ours"):  # each in its own process, as in memory_section
        out = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("benchmark.py")),
                "--lora-memory-child",
                which,
                "--device",
                str(device),
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
        )
        peaks[which] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    batch = inputs(device)
    dtypes = [d for d in args.dtypes if d == "fp32" or device.type == "cuda" or cpu_has_bf16()]
    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        models = dict(zip(("ours", "diffusers"), build_lora_unets(device, dtype)))
        trainable = {
            k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in models.items()
        }
        assert trainable["ours"] == trainable["diffusers"], trainable  # the same adapters
        steps = {
            label: lambda m=model, o=lora_optimizer(model), d=dtype: train_step(m, o, batch, d)
            for label, model in models.items()
        }
        times = paired_seconds(steps, device, args.steps, args.warmup)
        results = {label: statistics.median(seconds) for label, seconds in times.items()}
        # the speed-up of each pair: its median and spread say more than one ratio of medians
        pairs = sorted(d / o for d, o in zip(times["diffusers"], times["ours"]))
        spread = {
            "diffusers": "1.00x",
            "ours": f"{statistics.median(pairs):.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f})",
        }
        for label in ("diffusers", "ours"):
            memory = (
                f"{peaks[label] / 2**20:.0f} MiB | {peaks[label] / peaks['diffusers']:.2f}x"
                if name == "fp32"
                else " | "
            )
            rows.append(
                f"| {label} | {name} | {BATCH / results[label]:.2f} | {spread[label]} | {memory} |"
            )
            print(rows[-1], flush=True)
        del models, steps
    return rows


# The SD VAE's structure at half width (ch 64 instead of 128), 64x64 images, batch 4.


if __name__ == "__main__":  # alone: benchmark.py's lora table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(lora_section)
