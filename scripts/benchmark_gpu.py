"""Every GPU figure of issue 30 in one command: the model step, the run, the demo, sampling.

    python scripts/benchmark_gpu.py --out gpu.json             # on a CUDA machine, ~6 min
    python scripts/benchmark_gpu.py --tiny --out tiny.json     # every row at tiny width, CPU
    python scripts/benchmark_gpu.py --only model compile       # some rows

Rows (random weights only, nothing downloaded; the 512 px JPEGs are made here):
- model: one SD 1.x UNet training step (860 M, 64x64 latents = 512 px, batch 16, bf16
  autocast, fused AdamW): ours against diffusers' UNet2DConditionModel holding the same weights
  (converted with diffusers' own converter, as scripts/benchmark.py does), then ours with
  channels_last and ours with cuDNN attention (`attention_kernels`). img/s, TFLOP per image
  (FlopCounterMode, forward + backward), MFU against the card's bf16 dense peak (looked up by
  name; an unknown card prints no MFU) and peak memory.
- compile: ours under torch.compile (the compile time is printed, not counted).
- e2e: `main.py` with configs/stable-diffusion/v1-finetune.yaml (random weights, batch 16,
  bf16-mixed, use_checkpoint false, 8 loader workers): online (VAE + text encoder in the step)
  with the EMA as shipped and without it, and from the latent cache (scripts/cache_latents.py).
  img/s is the median rate between optimizer steps after a warm-up (a callback here times them).
- loop: scripts/benchmark_loop.py, when it exists (its own output).
- demo: scripts/demo.py end to end (data, training, grid, scores): seconds and colour/shape.
- sampling: 512 px, DPM++ 2M 20 steps, CFG 7.5: ours vs diffusers' StableDiffusionPipeline.
- swap: a DiT-XL/2 LoRA step with every block swapped to host RAM (`blocks_to_swap`), bf16 /
  fp8 / nf4 base, against the same step without swap: peak memory, time, and the largest
  difference of output and gradients (the CUDA-only paths of ldm.block_swap, run once).
- mmdit (issue 33 item 9): an SD 3.5 Medium MMDiT training step (2.5 B, 24 joint blocks,
  MMDiT-X) ours against diffusers' SD3Transformer2DModel with the same weights (diffusers'
  single-file converter; fp32 outputs compared first: max_out_diff), fused AdamW, bf16
  autocast, at 1024 px batch 1 and 512 px batch 4: img/s, vs diffusers, peak memory and its
  ratio (scripts/gpu_bench/families.py, reusing scripts/benchmark_mmdit.py).
- flux (issue 34 item 6): the same for Flux.1-dev's width at 4 double + 8 single blocks, 1024 px.
- flux_plan (issue 34 item 4): a full-size Flux.1-dev LoRA (rank 16, 1024 px, batch 1, built on
  the device in bf16) with an fp8 base and with nf4 + 20 blocks swapped: the plan of
  `python -m lun.memory_quant` (less its assumed 1 GiB CUDA runtime) against the measured peak
  (tensors held between steps + one step's peak above them), and their ratio.
- plan_auto (issue 34 item 4): main.py on an SD 1.x LoRA (fp8, `blocks_to_swap: auto`) told
  (`--device-memory`) and held to (the allocator's per-process fraction) a card smaller than
  its unswapped plan: the blocks it swaps, the plan's peak against the fit's.
- ema_test: pytest of the EMA's device-shadow test (skipped without an accelerator).
Each row runs in its own process (clean peak memory; a row that hangs is killed at its time
limit); a failed row prints one line and the run goes on. `--budget-s` skips rows whose
estimate no longer fits. The JSON (`--out`) is rewritten after every row.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

# The rows and how a figure is taken (card_peak, mfu, python are used by the tests from here).
from gpu_bench.families import (  # noqa: E402
    rows_ema_test,
    rows_flux,
    rows_flux_plan,
    rows_mmdit,
    rows_plan_auto,
)
from gpu_bench.measure import card_peak, environment, mfu, one_line, python, size  # noqa: E402
from gpu_bench.model import (  # noqa: E402
    rows_compile,
    rows_compile_channels_last,
    rows_model,
    rows_swap,
)
from gpu_bench.runs import rows_demo, rows_e2e, rows_e2e_no_ema, rows_loop, rows_sampling  # noqa: E402

__all__ = ["card_peak", "main", "mfu", "python"]

# --- the driver ---------------------------------------------------------------------------------
# name -> (function, estimated seconds on an H100, most seconds it may take)
# In this order: what no GPU run has measured yet first (the 2026-11-27 H100 lease reached model,
# e2e and demo only; swap is block swap's only run on a device), after the model row that the
# compile rows are read against. A row group that passes its limit is killed; its rows
# finished by then are kept. The family rows of issues 33 and 34 come last here, so that a
# plain run keeps its order; a GPU session runs them first with `--only` (docs/gpu.md,
# "Measuring"). Their estimates: imports ~10 s, building on the device (no CPU init) a few
# seconds, diffusers' conversion and moving a 10 GB side to the host and back ~10 s, and a few
# seconds of steps; plan_auto is two main.py start-ups of SD 1.x (random init on the CPU).
ROWS = {
    "model": (rows_model, 60, 150),
    "compile": (rows_compile, 100, 240),
    "loop": (rows_loop, 30, 90),
    "swap": (rows_swap, 60, 200),
    "demo": (rows_demo, 120, 240),
    "e2e": (rows_e2e, 120, 220),
    "e2e_no_ema": (rows_e2e_no_ema, 50, 100),
    "sampling": (rows_sampling, 50, 120),
    "compile_channels_last": (rows_compile_channels_last, 100, 240),
    "mmdit": (rows_mmdit, 75, 200),
    "flux_plan": (rows_flux_plan, 90, 240),
    "plan_auto": (rows_plan_auto, 100, 240),
    "ema_test": (rows_ema_test, 40, 120),
    "flux": (rows_flux, 70, 200),
}
TINY_LIMIT = 900  # seconds per row group at --tiny (no budget: a loaded CPU is slow)


def child(args) -> None:
    """`--row NAME`: run one row group in this process; each finished row is a JSON line."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        torch.set_num_threads(1)

    def emit(row):
        print("ROW " + json.dumps(row), flush=True)

    ROWS[args.row][0](args, size(args.tiny), device, emit)


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    base = next(
        (r["img_s"] for r in rows if r.get("row") == "model: diffusers" and "img_s" in r), None
    )
    lines = [
        "| row | img/s | vs diffusers | TFLOP/img | MFU | peak GiB | other |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = {
            k: v
            for k, v in r.items()
            if k not in ("row", "img_s", "tflop_per_img", "mfu", "peak_gib", "first_step_s")
        }
        other_text = ", ".join(
            f"{k} {fmt(v, '.3g') if isinstance(v, float) else v}"
            for k, v in other.items()
            if v is not None
        )
        ratio = (
            r["img_s"] / base if base and "img_s" in r and r["row"].startswith("model") else None
        )
        lines.append(
            f"| {r['row']} | {fmt(r.get('img_s'), '.2f')} | {fmt(ratio, '.2f')} | "
            f"{fmt(r.get('tflop_per_img'), '.3g')} | {fmt(r.get('mfu'), '.1%')} | "
            f"{fmt(r.get('peak_gib'), '.1f')} | {other_text} |"
        )
    return "\n".join(lines)


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="JSON file, rewritten after every row")
    parser.add_argument("--budget-s", type=float, default=360, help="seconds for all rows")
    parser.add_argument("--tiny", action="store_true", help="every row at tiny width (CPU)")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--work", help="folder for data and runs (default: a temporary one)")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--row-timeout", type=float, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        child(args)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(" ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if env["bf16_peak_tflops"] is None and device.type == "cuda":
        print(f"unknown card {env['card']!r}: no MFU (add it to BF16_DENSE_PEAKS)", flush=True)
    result = {"environment": env, "tiny": args.tiny, "rows": [], "skipped": []}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="benchmark-gpu-") as tmp:
        work = args.work or tmp
        for name in args.only:
            estimate, cap = ROWS[name][1:]
            left = args.budget_s - (time.monotonic() - start)
            if not args.tiny and left < estimate:
                print(f"{name}: skipped, ~{estimate} s would not fit in the {left:.0f} s left")
                result["skipped"].append(name)
                write_json(args.out, result)
                continue
            limit = max(1.0, min(cap, left)) if not args.tiny else TINY_LIMIT
            cmd = [
                sys.executable,
                __file__,
                "--row",
                name,
                "--work",
                work,
                "--row-timeout",
                str(limit),
            ] + (["--tiny"] if args.tiny else [])
            cmd += ["--device", str(device)]
            found = []

            def collect(line, found=found):
                if line.startswith("ROW "):
                    found.append(json.loads(line[4:]))
                    result["rows"].append(found[-1])
                    write_json(args.out, result)
                    print(table([found[-1]]).splitlines()[-1], flush=True)

            row_start = time.monotonic()
            try:
                python(cmd, timeout=limit, on_line=collect, new_session=True)
            except Exception as err:  # noqa: BLE001 - one line, the next row goes on
                print(
                    f"{name}: failed after {time.monotonic() - row_start:.0f} s: {one_line(err)}",
                    flush=True,
                )
                result["rows"].append({"row": name, "error": one_line(err)})
            write_json(args.out, result)
    result["seconds"] = time.monotonic() - start
    write_json(args.out, result)
    print("\n" + " ".join(f"{k} {v}" for k, v in env.items()))
    print(table(result["rows"]))
    if result["skipped"]:
        print(f"skipped (--budget-s): {', '.join(result['skipped'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
