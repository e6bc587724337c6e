"""What the latent cache saves: training steps online vs cached, and the cache's build speed.

    python scripts/benchmark_cache.py                 # both tables (about 10 min on 2 CPU cores)
    python scripts/benchmark_cache.py --only step --steps 3
    python scripts/benchmark.py --only cache          # the same, as a section of benchmark.py

- step: one training step (LatentDiffusion.diffusion_loss + backward + AdamW) of the SD v1
  structure at reduced UNet width (benchmark.py's UNET_PARAMS: model_channels 128, 32x32
  latents, batch 4) with the real SD VAE (ch 128, ch_mult 1 2 4 4, 2 res blocks: the full-size
  encoder, random weights) on 256 px images, and a CLIP ViT-L/14-sized text encoder: online
  (VAE + text encoder every step), cached latents (posterior moments, sampled per step), cached
  latents + text. The three take turns step by step. Then the FLOPs of each part
  (torch.utils.flop_counter) at this shape and at SD 1.x's real one (UNet width 320, 512 px):
  the GPU projection assumes each part runs at the same share of the device's peak.
- build: images/s of scripts/cache_latents.py (1 and 2 processes, encoding time only, from its
  log) against diffusers' AutoencoderKL of the same config in a plain loop (PIL open, convert,
  resize, crop, encode), both on the same 1024 px JPEGs to 256 px.
Figures from a shared machine are noisy: the ratios, measured in one run, are what to read.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_common import BATCH, UNET_PARAMS, alternated_median_seconds  # noqa: E402
from benchmark_data import PlainPipeline, make_sources  # noqa: E402

IMAGE = 256  # px (32x32 latents); --image changes it
SD_VAE = {  # the SD v1/v2 first stage, full width
    "embed_dim": 4,
    "ddconfig": {
        "double_z": True,
        "z_channels": 4,
        "resolution": 256,
        "in_channels": 3,
        "out_ch": 3,
        "ch": 128,
        "ch_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "attn_resolutions": [],
        "dropout": 0.0,
    },
}
SD_UNET = {**UNET_PARAMS, "model_channels": 320}


def model_config(unet: dict, text: dict | None = None) -> dict:
    """A LatentDiffusion config: `unet`, SD's VAE, and `text` (default: SD's CLIP ViT-L/14)."""
    from ldm.text_encoder import CLIP_VIT_L14_TEXT_CONFIG

    text = text or CLIP_VIT_L14_TEXT_CONFIG
    return {
        "target": "ldm.diffusion.LatentDiffusion",
        "params": {
            "scale_factor": 0.18215,
            "unet_config": {"target": "ldm.unet.UNetModel", "params": unet},
            "first_stage_config": {"target": "ldm.autoencoder.AutoencoderKL", "params": SD_VAE},
            "cond_stage_config": {
                "target": "ldm.text_encoder.FrozenCLIPEmbedder",
                "params": {"config": text},
            },
        },
    }


def batches(model, image: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    images = torch.rand(BATCH, 3, image, image, generator=g) * 2 - 1
    captions = [f"a photo number {i} of a red circle" for i in range(BATCH)]
    with torch.no_grad():
        moments = model.first_stage_moments(images)
        context = model.encode_captions(captions)
    return {
        "online": {"image": images, "caption": captions},
        "cached latents": {"latent": moments, "caption": captions},
        "cached latents + text": {"latent": moments, "caption": captions, "context": context},
    }


def step_section(args) -> list[str]:
    import torch

    from ldm.optim import build_optimizer
    from ldm.util import instantiate_from_config

    torch.manual_seed(0)
    model = instantiate_from_config(model_config(UNET_PARAMS)).train()
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    runs = batches(model, args.image)

    def step(batch):
        loss = model.diffusion_loss(batch)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = {label: (lambda b=batch: step(b)) for label, batch in runs.items()}
    if args.cpu_seconds:
        seconds = cpu_seconds(steps, args.steps, args.warmup)
    else:
        seconds = alternated_median_seconds(steps, torch.device("cpu"), args.steps, args.warmup)
    rows = [
        f"| training step (UNet ch 128, SD VAE, CLIP-L size, batch {BATCH}, {args.image} px) "
        f"| {'CPU s/step (1 thread)' if args.cpu_seconds else 's/step'} | img/s | vs online |",
        "|---|---|---|---|",
    ]
    for label, s in seconds.items():
        rows.append(f"| {label} | {s:.2f} | {BATCH / s:.2f} | {seconds['online'] / s:.2f}x |")
        print(rows[-1], flush=True)
    return rows + [""] + flop_rows(args.image)


def cpu_seconds(steps: dict, repeats: int, warmup: int) -> dict:
    """Median CPU seconds of each step on one thread, taking turns: on a machine shared with
    other jobs the CPU time a step needs is steadier than its wall clock."""
    import torch

    torch.set_num_threads(1)
    times = {label: [] for label in steps}
    for repeat in range(warmup + repeats):
        for label, step in steps.items():
            start = time.process_time()
            step()
            if repeat >= warmup:
                times[label].append(time.process_time() - start)
    return {label: sorted(t)[len(t) // 2] for label, t in times.items()}


def part_flops(unet: dict, image: int) -> dict[str, float]:
    """FLOPs per image of the VAE encode, the text encoder and the UNet training step (fwd +
    bwd), counted on fake tensors (shapes only: no memory, no time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return _count(unet, image)


def _count(unet: dict, image: int) -> dict[str, float]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ldm.util import instantiate_from_config

    model = instantiate_from_config(model_config(unet))
    side = image // 8
    x = torch.empty(1, 3, image, image)
    z = torch.empty(1, 4, side, side, requires_grad=True)
    t = torch.zeros(1, dtype=torch.long)
    counts = {}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.first_stage_moments(x)
    counts["VAE encode"] = counter.get_total_flops()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.encode_captions([""])  # padded to 77 tokens, as the step's captions
    counts["text encoder"] = counter.get_total_flops()
    context = torch.empty(1, 77, 768)
    with FlopCounterMode(display=False) as counter:
        model.model(z, t, {"crossattn": context}).sum().backward()
    counts["UNet train step"] = counter.get_total_flops()
    return counts


def flop_rows(image: int) -> list[str]:
    rows = [
        "| FLOPs per image | VAE encode | text encoder | UNet train step | projected: cached latents "
        "| cached latents + text |",
        "|---|---|---|---|---|---|",
    ]
    for label, unet, side in (
        (f"this benchmark (ch 128, {image} px)", UNET_PARAMS, image),
        ("SD 1.x (ch 320, 512 px)", SD_UNET, 512),
    ):
        f = part_flops(unet, side)
        total = sum(f.values())
        latents = total / (f["UNet train step"] + f["text encoder"])
        both = total / f["UNet train step"]
        rows.append(
            f"| {label} | {f['VAE encode'] / 1e12:.2f} T | {f['text encoder'] / 1e12:.3f} T | "
            f"{f['UNet train step'] / 1e12:.2f} T | {latents:.2f}x | {both:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


def cache_seconds(log: str) -> tuple[int, float]:
    """(images, seconds) of the slowest rank, from cache_latents.py's "rank R: N images in S s"."""
    found = [
        (int(n), float(s)) for n, s in re.findall(r"rank \d+: (\d+) images in ([\d.]+) s", log)
    ]
    return sum(n for n, _ in found), max(s for _, s in found)


def diffusers_loop(root: Path, size: int, batch_size: int) -> float:
    """img/s of the usual loop: PIL pipeline + diffusers' AutoencoderKL.encode, one process."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=[128, 256, 512, 512],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        layers_per_block=2,
        latent_channels=4,
        sample_size=size,
    ).eval()
    data = PlainPipeline(root, size)
    start = time.perf_counter()
    with torch.no_grad():
        for at in range(0, len(data), batch_size):
            images = torch.stack(
                [data[i]["image"] for i in range(at, min(at + batch_size, len(data)))]
            )
            vae.encode(images).latent_dist.sample()
    return len(data) / (time.perf_counter() - start)


def build_section(args) -> list[str]:
    from ldm.text_encoder import CLIP_VIT_L14_TEXT_CONFIG

    rows = [
        f"| cache build, {args.images} JPEGs 1024 px -> {args.image} px, SD VAE | img/s | vs diffusers loop |",
        "|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = make_sources(Path(tmp) / "data", args.images, 1024)
        config = {
            # latents only: a 1-layer text encoder keeps the script's start-up short
            "model": model_config(
                UNET_PARAMS, {**CLIP_VIT_L14_TEXT_CONFIG, "num_hidden_layers": 1}
            ),
            "data": {
                "target": "lun.data.DataModule",
                "params": {
                    "train": {
                        "target": "lun.data.local.Local",
                        "params": {"data_root": str(root), "size": args.image, "cache_dir": False},
                    }
                },
            },
        }
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        theirs = diffusers_loop(root, args.image, 4)
        measured = {"diffusers AutoencoderKL, plain loop": theirs}
        for processes in (1, 2):
            out = Path(tmp) / f"cache{processes}"
            result = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "cache_latents.py"), "--base", str(path)]
                + ["--out", str(out), "--batch-size", "4", "--workers", "1"]
                + ["--processes", str(processes)],
                capture_output=True,
                text=True,
                check=True,
            )
            images, seconds = cache_seconds(result.stderr)
            measured[f"scripts/cache_latents.py, {processes} process(es)"] = images / seconds
    for label, rate in measured.items():
        rows.append(f"| {label} | {rate:.2f} | {rate / theirs:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> list[str]:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--only", nargs="+", choices=["step", "build"], default=["step", "build"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--images", type=int, default=16, help="images the build encodes")
    parser.add_argument("--image", type=int, default=IMAGE, help="image side in px")
    parser.add_argument(
        "--cpu-seconds",
        action="store_true",
        help="step: CPU seconds on one thread instead of the wall clock (a busy machine)",
    )
    args = parser.parse_args(argv)
    import torch  # after parsing: --help answers at once

    print(f"cpu, torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    tables = []
    if "step" in args.only:
        tables.append(step_section(args))
    if "build" in args.only:
        tables.append(build_section(args))
    print()
    for table in tables:
        print("\n".join(table) + "\n")
    return [row for table in tables for row in table]


if __name__ == "__main__":
    main()
