"""What scripts/benchmark.py and its sections (scripts/benchmark_*.py, bench_backbone.py) share:
the reduced SD-v1 UNet both sides build with the same weights, its inputs and training step, the
timing loop (the compared steps take turns), the memory readings, and the flags every section
reads. The sections import this module and scripts/benchmark.py imports the sections, so no
section imports benchmark.py (no import circle: tests/project/test_architecture.py).

A section runs alone through `run_alone`: `python scripts/benchmark_dit.py --steps 3` prints
the table `python scripts/benchmark.py --only dit --steps 3` prints.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

BATCH, LATENT, CONTEXT = 4, 32, (77, 768)
UNET_PARAMS = {  # SD v1 structure, width 128 instead of 320
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 128,
    "attention_resolutions": [4, 2, 1],
    "num_res_blocks": 2,
    "channel_mult": [1, 2, 4, 4],
    "num_heads": 8,
    "use_spatial_transformer": True,
    "transformer_depth": 1,
    "context_dim": 768,
    "legacy": False,
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # torch dtype names: torch is imported late


def original_config(unet_params: dict) -> dict:
    """An original-style config (as diffusers' converters read it) around our UNet params."""
    return {
        "model": {
            "target": "ldm.diffusion.LatentDiffusion",
            "params": {
                "linear_start": 0.00085,
                "linear_end": 0.012,
                "timesteps": 1000,
                "scale_factor": 0.18215,
                "image_size": 32,
                "unet_config": {"target": "ldm.unet.UNetModel", "params": unet_params},
                "first_stage_config": {
                    "target": "ldm.autoencoder.AutoencoderKL",
                    "params": {
                        "embed_dim": 4,
                        "ddconfig": {
                            "double_z": True,
                            "z_channels": 4,
                            "resolution": 256,
                            "in_channels": 3,
                            "out_ch": 3,
                            "ch": 64,
                            "ch_mult": [1, 2, 4, 4],
                            "num_res_blocks": 1,
                            "attn_resolutions": [],
                            "dropout": 0.0,
                        },
                    },
                },
                "cond_stage_config": {
                    "target": "ldm.text_encoder.FrozenCLIPEmbedder",
                    "params": {
                        "config": {
                            "hidden_size": 768,
                            "intermediate_size": 1536,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 12,
                        }
                    },
                },
            },
        }
    }


def build_unets(device, gradient_checkpointing=False, trained_like=False):
    """Our UNet and diffusers' UNet2DConditionModel with the same weights; `trained_like`: every
    weight moved by seeded noise, so the zero-initialised output layers do not zero the gradients
    that reach a frozen base's adapters."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    from ldm.layout import original
    from ldm.util import instantiate_from_config

    torch.manual_seed(0)
    ours = instantiate_from_config({"target": "ldm.unet.UNetModel", "params": UNET_PARAMS})
    if trained_like:
        with torch.no_grad():
            for param in ours.parameters():
                param.add_(0.02 * torch.randn(param.shape))
    state = {original.unet_key(k): v for k, v in ours.state_dict().items()}
    config = create_unet_diffusers_config_from_ldm(original_config(UNET_PARAMS), state)
    theirs = UNet2DConditionModel(**config)
    theirs.load_state_dict(convert_ldm_unet_checkpoint(state, config))
    if gradient_checkpointing:
        ours.set_gradient_checkpointing(True)
        theirs.enable_gradient_checkpointing()
    return ours.to(device).train(), theirs.to(device).train()


def inputs(device):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 4, LATENT, LATENT, generator=g)
    t = torch.randint(0, 1000, (BATCH,), generator=g)
    context = torch.randn(BATCH, *CONTEXT, generator=g)
    target = torch.randn(x.shape, generator=g)
    return [v.to(device) for v in (x, t, context, target)]


def forward(model, x, t, context):
    if hasattr(model, "dtype") and type(model).__name__ == "UNet2DConditionModel":
        return model(x, t, encoder_hidden_states=context).sample
    return model(x, t, {"crossattn": context})


def train_step(model, optimizer, batch, dtype):
    import torch
    import torch.nn.functional as F

    x, t, context, target = batch
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = F.mse_loss(forward(model, x, t, context).float(), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, steps, warmup) -> float:
    return alternated_median_seconds({"only": fn}, device, steps, warmup)["only"]


def step_flops(model, batch) -> int:
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    x, t, context, target = batch
    with FlopCounterMode(display=False) as counter:
        F.mse_loss(forward(model, x, t, context).float(), target).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def alternated_median_seconds(steps: dict, device, repeats, warmup) -> dict:
    """Median seconds of each callable in `steps`, run in turn so that they share the machine's
    load alike (on a shared machine the wall clock of one step swings several-fold)."""
    times = {label: [] for label in steps}
    for repeat in range(warmup + repeats):
        for label, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            if repeat >= warmup:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(seconds) for label, seconds in times.items()}


def _proc_status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_has_bf16() -> bool:
    """AVX512-bf16 or AMX: without them bf16 matmuls on CPU are emulated and many times slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every section (benchmark.py adds `--only` and its child processes')."""
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        default=list(DTYPES),
        help="train section dtypes (bf16 is ~20x slower than fp32 on CPUs without AVX512-bf16)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--sample-runs", type=int, default=2, help="sampling section: runs")
    parser.add_argument(
        "--cpu-seconds",
        action="store_true",
        help="dit, sdxl, flux, mmdit sections on CPU: time steps in CPU seconds on one thread "
        "(shared machines)",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def device_of(args: argparse.Namespace):
    """`--device`, else CUDA when present, else the CPU."""
    import torch  # after parsing: --help answers at once

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def say_device(device) -> None:
    import torch

    print(
        f"device: {device}, torch {torch.__version__}, threads {torch.get_num_threads()}",
        flush=True,
    )


def print_tables(tables: list[list[str]]) -> None:
    print()
    for table in tables:
        print("\n".join(table) + "\n")


def run_alone(section: Callable, argv: list[str] | None = None) -> None:
    """A section's script run alone: its table, with benchmark.py's flags (`--help`)."""
    from lun.cli import HelpFormatter

    doc = sys.modules[section.__module__].__doc__
    parser = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    device = device_of(args)
    say_device(device)
    print_tables([section(args, device)])
