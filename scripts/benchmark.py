"""Speed and memory of our models against diffusers, measured side by side in one run.

    python scripts/benchmark.py                    # everything (about 10 min on 2 CPU cores)
    python scripts/benchmark.py --only train --steps 3

Sections (each prints a markdown table; ratios are ours / diffusers, > 1 = we are faster):
- train: one UNet training step (forward + backward + AdamW) at the SD-v1 structure with reduced
  width (model_channels 128, 32x32 latents, context 77x768, batch 4), fp32 and bf16 autocast;
  each side with its default optimizer (ours: fused AdamW; diffusers' examples: torch's AdamW).
  The two models take turns, step by step.
  Both models hold the same weights (ours converted with diffusers' own converter). Achieved
  FLOP/s (FlopCounterMode) and its share of this machine's matmul peak at that dtype.
- memory: peak memory of that step (RSS on CPU, max allocated on CUDA), ours vs diffusers, and
  how much of the step's activation memory gradient checkpointing saves. Each model runs in its
  own process so one's allocations do not hide the other's.
- sampling: seconds per 256x256 image with classifier-free guidance, 20-step DPM++ 2M and
  50-step DDIM, our sampler vs diffusers' StableDiffusionPipeline on the same converted weights.
- data: our loader vs a plain PIL pipeline (scripts/benchmark_data.py, 512 and 1024 px JPEG ->
  512), its rate per worker and the workers an 80 img/s GPU step needs.
- loop: ms per optimizer step of main.py (Lightning and every default callback) against a plain
  PyTorch loop of the same model, data and optimizer (the demo UNet, 1 thread), the overhead,
  and the steps that read a tensor value on the host (scripts/benchmark_loop.py).
- dit (scripts/benchmark_dit.py): one DiT-S/2 and DiT-B/2 training step (batch 4, 32x32x4
  latents = 256 px images, 1000 classes, learned sigma; on a CPU DiT-B/2 at batch 2, 16x16x4,
  see DIT_ROWS) against diffusers' DiTTransformer2DModel holding the same weights
  (ldm.layout.dit.dit_to_diffusers), both with the same fused AdamW, taking turns (A B B A);
  fp32, and bf16 autocast where the CPU has bf16 instructions (or on CUDA). Forward GFLOP per
  image (FlopCounterMode: 2 per multiply-add, so twice the "Gflops" of the DiT paper's table 4)
  and the achieved share of the measured matmul peak. `--cpu-seconds`: timed in CPU seconds on
  one thread (for a shared machine).
- cache: training steps online vs from the latent cache, the GPU projection from FLOP counts,
  and the cache's build speed against diffusers' AutoencoderKL in a plain loop
  (scripts/benchmark_cache.py, CPU).
- lora: one LoRA training step (rank 16 on to_q/k/v/out.0, gaussian init: the setup of diffusers'
  train_text_to_image_lora.py) of that UNet: ours (ldm.lora) against diffusers'
  UNet2DConditionModel + peft `add_adapter`, the same base weights and the same fused AdamW over
  the adapters, taking turns; peak memory of each in its own process (fp32).
- vae: one KL-autoencoder training step (encode, sample, decode, L1 + KL, backward, Adam) of our
  trainer (`AutoencoderKLTraining`'s generator loss) against diffusers' AutoencoderKL holding the
  same weights with the same loss terms (no LPIPS, no discriminator on either side), SD VAE
  structure at half width (ch 64), 64x64 images, batch 4; fp32 and bf16 (as in dit).
- sdxl: one SDXL-structure UNet training step (width 64, transformer depth 1/2/4, text_time
  `label_emb`, context 77x2048, batch 2, 32x32) against diffusers' UNet2DConditionModel in the
  same structure holding the same weights, the same fused AdamW, fp32 (scripts/benchmark_sdxl.py).
- flux: one Flux.1-dev-structure training step (width 768, 2 double + 4 single blocks, 32x32x16
  latent, 64 T5 tokens, batch 1) against diffusers' FluxTransformer2DModel holding the same
  weights, the same fused AdamW, fp32 (scripts/benchmark_flux.py).
- quant_lora: a LoRA step of that Flux on an int8 / nf4 / fp8 frozen base against diffusers + peft
  + bitsandbytes, speed and peak-memory ratios (scripts/benchmark_quant_lora.py).
- mmdit: one SD 3.5 Medium-structure MMDiT training step (width 1536, 2 joint blocks, 64x64x16
  latent, 154 text tokens, batch 1) against diffusers' SD3Transformer2DModel holding the same
  weights, the same fused AdamW, fp32, and the peak memory of each (scripts/benchmark_mmdit.py).
Median of `--steps` steps after `--warmup`. The device is CUDA when present, else CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import (
    BATCH,
    DTYPES,
    UNET_PARAMS,
    _proc_status,
    add_arguments,
    alternated_median_seconds,
    build_unets,
    device_of,
    inputs,
    median_seconds,
    original_config,
    print_tables,
    say_device,
    step_flops,
    train_step,
)


def matmul_peak(device, dtype, n=2048, reps=10) -> float:
    """FLOP/s of a large square matmul: the machine's practical peak at this dtype."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = median_seconds(lambda: a @ b, device, reps, 2)
    return 2 * n**3 / seconds


def default_optimizer(which: str, model) -> torch.optim.Optimizer:
    """Each side's default: ours is what LatentDiffusion.configure_optimizers builds (fused
    AdamW); diffusers' training examples use torch.optim.AdamW as it comes."""
    import torch

    from ldm.optim import build_optimizer

    if which == "ours":
        return build_optimizer(model.parameters(), lr=1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def train_section(args, device) -> list[str]:
    import torch

    rows = [
        "| UNet train step (batch 4, 32x32, ch 128) | dtype | img/s | vs diffusers | TFLOP/s | of matmul peak |",
        "|---|---|---|---|---|---|",
    ]
    ours, theirs = build_unets(device)
    batch = inputs(device)
    flops = {"ours": step_flops(ours, batch), "diffusers": step_flops(theirs, batch)}
    optimizers = {
        "diffusers": default_optimizer("diffusers", theirs),
        "ours": default_optimizer("ours", ours),
    }
    for name in args.dtypes:
        dtype = getattr(torch, DTYPES[name])
        peak = matmul_peak(device, dtype)
        steps = {
            label: lambda m=model, o=optimizers[label], d=dtype: train_step(m, o, batch, d)
            for label, model in (("diffusers", theirs), ("ours", ours))
        }
        results = alternated_median_seconds(steps, device, args.steps, args.warmup)
        for label in ("diffusers", "ours"):
            achieved = flops[label] / results[label]
            ratio = results["diffusers"] / results[label]
            rows.append(
                f"| {label} | {name} | {BATCH / results[label]:.2f} | {ratio:.2f}x | "
                f"{achieved / 1e12:.3f} | {achieved / peak:.0%} |"
            )
            print(rows[-1], flush=True)
    return rows


def memory_child(which: str, checkpointing: bool, device) -> None:
    """Runs in its own process: prints peak and activation memory of one training step (bytes).

    Activations = the step's peak above the weights and optimizer state, less the gradients
    (which every step allocates alike). On CPU the parent sets a fixed malloc mmap threshold so
    that freed tensors leave the resident set and RSS follows the live tensors.
    """
    import torch

    ours, theirs = build_unets(device, gradient_checkpointing=checkpointing)
    model = ours if which == "ours" else theirs
    del ours, theirs
    optimizer = default_optimizer(which, model)
    batch = inputs(device)
    train_step(model, optimizer, batch, torch.float32)  # allocates the optimizer state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        train_step(model, optimizer, batch, torch.float32)
        peak = torch.cuda.max_memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM)
        before = _proc_status("VmRSS")
        train_step(model, optimizer, batch, torch.float32)
        peak = _proc_status("VmHWM")
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak": peak, "activations": peak - before - gradients}))


def memory_section(args, device) -> list[str]:
    rows = [
        "| UNet train step memory (fp32) | peak | activations | vs diffusers (peak) |",
        "|---|---|---|---|",
    ]
    measured = {}
    for which in ("diffusers", "ours"):
        for checkpointing in (False, True):
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", which, "--device", str(device)]
                + (["--checkpointing"] if checkpointing else []),
                capture_output=True,
                text=True,
                check=True,
                # glibc otherwise raises its mmap threshold as large blocks are freed, keeps
                # later ones on its heap, and RSS stops falling when tensors are freed.
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
            )
            measured[which, checkpointing] = json.loads(out.stdout.strip().splitlines()[-1])
    for which in ("diffusers", "ours"):
        for checkpointing in (False, True):
            m = measured[which, checkpointing]
            ratio = m["peak"] / measured["diffusers", checkpointing]["peak"]
            label = which + (" + gradient checkpointing" if checkpointing else "")
            rows.append(
                f"| {label} | {m['peak'] / 2**20:.0f} MiB | {m['activations'] / 2**20:.0f} MiB | {ratio:.2f}x |"
            )
    saved = 1 - measured["ours", True]["activations"] / measured["ours", False]["activations"]
    rows.append(f"| ours: activation memory saved by gradient checkpointing | {saved:.0%} | | |")
    print("\n".join(rows), flush=True)
    return rows


def sampling_section(args, device) -> list[str]:
    import torch
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    from ldm.util import instantiate_from_config

    sys.path.insert(0, str(Path(__file__).parent))
    from convert import export_diffusers

    config = original_config(UNET_PARAMS)
    torch.manual_seed(0)
    model = instantiate_from_config(config["model"]).eval().to(device)
    with tempfile.TemporaryDirectory() as folder:
        export_diffusers(model.state_dict(), copy.deepcopy(config), Path(folder))
        pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    ddim = pipe.scheduler
    dpm = DPMSolverMultistepScheduler.from_config(ddim.config)
    rows = [
        "| sampling 256x256, CFG 7.5 | steps | ours s/img | diffusers s/img | ratio |",
        "|---|---|---|---|---|",
    ]
    prompt = "a red circle on a white background"
    for sampler, steps, scheduler in (("dpmpp_2m", 20, dpm), ("ddim", 50, ddim)):
        pipe.scheduler = scheduler
        with torch.no_grad():
            ours = median_seconds(
                lambda s=sampler, n=steps: model.sample(
                    [prompt], height=256, width=256, sampler=s, steps=n, scale=7.5
                ),
                device,
                args.sample_runs,
                1,
            )
            theirs = median_seconds(
                lambda n=steps: pipe(
                    prompt,
                    height=256,
                    width=256,
                    num_inference_steps=n,
                    guidance_scale=7.5,
                    output_type="pt",
                ),
                device,
                args.sample_runs,
                1,
            )
        rows.append(f"| {sampler} | {steps} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def data_section(args) -> list[str]:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from benchmark_data import loader_table

    torch.set_num_threads(1)
    data_args = argparse.Namespace(
        sizes=[512, 1024], target=512, n=64, workers=[0, 2], repeats=2, gpu_rate=80.0
    )
    with tempfile.TemporaryDirectory() as tmp:
        return loader_table(data_args, Path(tmp))


SECTIONS = [
    "train",
    "memory",
    "sampling",
    "data",
    "dit",
    "cache",
    "lora",
    "vae",
    "sdxl",
    "flux",
    "quant_lora",
    "mmdit",
    "loop",
]


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=SECTIONS,
        help="sections to run (scripts/benchmark_<section>.py runs one alone)",
    )
    add_arguments(parser)
    parser.add_argument("--memory-child", choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--lora-memory-child", choices=["ours", "diffusers"], help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    device = device_of(args)
    if args.memory_child:
        memory_child(args.memory_child, args.checkpointing, device)
        return
    if args.lora_memory_child:
        from benchmark_lora import lora_memory_child

        lora_memory_child(args.lora_memory_child, device)
        return
    say_device(device)
    from benchmark_dit import dit_section
    from benchmark_flux import flux_section
    from benchmark_lora import lora_section
    from benchmark_mmdit import mmdit_section
    from benchmark_quant_lora import quant_lora_section
    from benchmark_sdxl import sdxl_section
    from benchmark_vae import vae_section

    sections = {
        "train": train_section,
        "memory": memory_section,
        "sampling": sampling_section,
        "dit": dit_section,
        "lora": lora_section,
        "vae": vae_section,
        "sdxl": sdxl_section,
        "flux": flux_section,
        "quant_lora": quant_lora_section,
        "mmdit": mmdit_section,
    }
    tables = [sections[name](args, device) for name in args.only if name in sections]
    if "data" in args.only:
        tables.append(data_section(args))
    if "cache" in args.only:
        from benchmark_cache import main as cache_benchmark

        tables.append(cache_benchmark(["--steps", str(args.steps), "--warmup", str(args.warmup)]))
    if "loop" in args.only:
        from benchmark_loop import main as loop_benchmark

        tables.append(loop_benchmark([]))
    print_tables(tables)


if __name__ == "__main__":
    main()
