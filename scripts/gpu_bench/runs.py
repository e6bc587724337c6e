"""The run rows of scripts/benchmark_gpu.py: main.py end to end (online with and without the
EMA, from the latent cache), the loop benchmark, the demo, and sampling against diffusers'
StableDiffusionPipeline."""

import copy
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_bench.measure import (
    ROOT,
    TINY_TEXT,
    TINY_UNET,
    TINY_VAE,
    attempt,
    median_rate,
    one_line,
    python,
    synchronize,
    tail,
)


# --- end to end: main.py ------------------------------------------------------------------------
class StepTimer(pl.Callback):
    """A callback (named in the e2e configs): the seconds from the start of step `warmup` to the
    end of the last step, the device synchronised at both ends only (none in between, so the
    loop's own host work can overlap the device as it does in a real run)."""

    def __init__(self, out: str, warmup: int):
        self.out, self.warmup, self.start = out, warmup, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup and self.start is None:
            synchronize(pl_module.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= trainer.max_steps and self.start is not None:
            synchronize(pl_module.device)
            seconds = time.perf_counter() - self.start
            steps = trainer.global_step - self.warmup
            Path(self.out).write_text(json.dumps({"steps": steps, "seconds": seconds}))


def e2e_config(args, s, folder: Path, data_root: Path, timer: Path, ema: bool) -> Path:
    from ldm.text_encoder import CLIP_VIT_L14_TEXT_CONFIG

    tiny = args.tiny
    unet = {**TINY_UNET, "use_checkpoint": False} if tiny else {"use_checkpoint": False}
    vae = {"ddconfig": TINY_VAE} if tiny else {}
    config = {
        "model": {
            "params": {
                "ckpt_path": None,
                "unet_config": {"params": unet},
                "first_stage_config": {"params": vae},
                "cond_stage_config": {
                    "params": {"config": TINY_TEXT if tiny else CLIP_VIT_L14_TEXT_CONFIG}
                },
            }
        },
        "data": {
            "params": {
                "batch_size": s["batch"],
                "num_workers": s["workers"],
                # center: the cache holds one crop (the JPEGs are square at this side anyway)
                "train": {
                    "params": {"data_root": str(data_root), "size": s["image"], "crop": "center"}
                },
            }
        },
        "lightning": {
            "trainer": {
                "max_steps": s["e2e_steps"],
                "precision": "32" if tiny else "bf16-mixed",
                "log_every_n_steps": 10,
            },
            "callbacks": {
                "image_logger": None,
                "modelcheckpoint": {"params": {"save_on_train_end": False}},
                "step_timer": {
                    "target": "gpu_bench.runs.StepTimer",
                    "params": {"out": str(timer), "warmup": s["e2e_steps"] // 3},
                },
                **({} if ema else {"ema": None}),
            },
        },
    }
    path = folder / f"e2e-{'ema' if ema else 'noema'}-{time.time_ns()}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def jpegs(folder: Path, count: int, side: int) -> Path:
    from benchmark_data import make_sources

    root = folder / f"jpegs-{side}"
    if not (root / "images").is_dir():
        make_sources(root, count, side)
    return root


def run_main(args, s, folder: Path, ema: bool, cache: Path | None = None) -> dict:
    data = jpegs(folder, s["images"], s["image"])
    timer = folder / f"timer-{time.time_ns()}.txt"
    overlay = e2e_config(args, s, folder, data, timer, ema)
    base = ROOT / "configs" / "stable-diffusion" / "v1-finetune.yaml"
    extra = [f"data.params.cache={cache}"] if cache else []
    cmd = [
        sys.executable,
        "main.py",
        "--base",
        str(base),
        str(overlay),
        *extra,
        "-t",
        "--no-test",
        "-l",
        str(folder / "logs"),
    ]
    started = time.perf_counter()
    out = python(cmd, timeout=args.row_timeout)
    if not timer.exists():
        raise RuntimeError(f"main.py timed no steps: {tail(out)}")
    timed = json.loads(timer.read_text())
    rate = s["batch"] * timed["steps"] / timed["seconds"]
    wait = re.findall(r"data wait[^0-9]*([0-9.]+) ?%", out)
    return {
        "img_s": rate,
        "run_s": time.perf_counter() - started,
        "data_wait_pct": float(wait[-1]) if wait else None,
    }


def rows_e2e(args, s, device, emit) -> None:
    folder = Path(args.work)
    attempt(emit, "e2e: main.py online, EMA", lambda: run_main(args, s, folder, ema=True))

    def cached():
        cache = folder / "cache"
        data = jpegs(folder, s["images"], s["image"])
        overlay = e2e_config(args, s, folder, data, folder / "unused.txt", ema=True)
        base = ROOT / "configs" / "stable-diffusion" / "v1-finetune.yaml"
        started = time.perf_counter()
        python(
            [
                sys.executable,
                "scripts/cache_latents.py",
                "--base",
                str(base),
                str(overlay),
                "--out",
                str(cache),
            ],
            timeout=args.row_timeout,
        )
        built = time.perf_counter() - started
        row = run_main(args, s, folder, True, cache)
        return {**row, "note": f"cache of {s['images']} images built in {built:.0f} s"}

    attempt(emit, "e2e: main.py from the latent cache, EMA", cached)


def rows_e2e_no_ema(args, s, device, emit) -> None:
    folder = Path(args.work)
    attempt(emit, "e2e: main.py online, no EMA", lambda: run_main(args, s, folder, ema=False))


# --- loop, demo, sampling -----------------------------------------------------------------------
def rows_loop(args, s, device, emit) -> None:
    script = ROOT / "scripts" / "benchmark_loop.py"
    if not script.exists():
        emit({"row": "loop", "skipped": "scripts/benchmark_loop.py is not there"})
        return
    where = ["--device", "cuda"] if device.type == "cuda" else []
    out = python([sys.executable, str(script), *where], timeout=args.row_timeout)
    figures = loop_figures(out)
    row = {"row": "loop: main.py against a plain loop (ms per optimizer step)", **figures}
    emit(row if figures else {**row, "output": tail(out, 12)})


# benchmark_loop.py's table rows -> this row's keys (the wall and CPU figures of each)
LOOP_ROWS = {
    "plain PyTorch loop": "plain",
    "main.py, every default callback": "main",
    "overhead of the loop": "overhead",
}


def loop_figures(output: str) -> dict:
    """The loop row's figures from benchmark_loop.py's table: wall and CPU ms per step of the
    plain loop and of main.py, and the loop's own overhead; the steps with host reads."""
    figures = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for label, key in LOOP_ROWS.items():
            if len(cells) >= 3 and cells[0].startswith(label):
                wall, cpu = (cell.split()[0] for cell in cells[1:3])
                figures[f"{key}_ms"], figures[f"{key}_cpu_ms"] = float(wall), float(cpu)
        if cells and cells[0].startswith("steps of main.py with host reads") and len(cells) > 1:
            figures["host_read_steps"] = cells[1]
    return figures


def rows_demo(args, s, device, emit) -> None:
    folder = Path(args.work)
    cmd = [
        sys.executable,
        "scripts/demo.py",
        "--data",
        str(folder / "shapes"),
        "--logdir",
        str(folder / "demo-logs"),
    ]
    if args.tiny:
        cmd += ["--max-steps", "4", "--n-images", "48"]
    marks = {}
    started = time.perf_counter()

    def mark(line):
        for key, text in (("train", "$ python main.py"), ("draw", "$ python scripts/txt2img.py")):
            if line.startswith(text):
                marks[key] = time.perf_counter()

    out = python(cmd, timeout=args.row_timeout, on_line=mark)
    total = time.perf_counter() - started
    colour = re.findall(r"colour accuracy ([0-9.]+) %", out)
    shape = re.findall(r"shape accuracy ([0-9.]+) %", out)
    train = marks["draw"] - marks["train"] if {"train", "draw"} <= set(marks) else None
    emit(
        {
            "row": "demo: scripts/demo.py",
            "run_s": total,
            "train_s": train,
            "colour_pct": float(colour[-1]) if colour else None,
            "shape_pct": float(shape[-1]) if shape else None,
        }
    )


def rows_sampling(args, s, device, emit) -> None:
    from bench_common import original_config
    from convert import export_diffusers
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    from ldm.util import instantiate_from_config

    config = original_config(s["unet"])
    if not args.tiny:  # the real VAE and text encoder sizes
        from benchmark_cache import SD_VAE

        from ldm.text_encoder import CLIP_VIT_L14_TEXT_CONFIG

        params = config["model"]["params"]
        params["first_stage_config"]["params"] = copy.deepcopy(SD_VAE)
        params["cond_stage_config"]["params"]["config"] = dict(CLIP_VIT_L14_TEXT_CONFIG)
    torch.manual_seed(0)
    model = instantiate_from_config(copy.deepcopy(config)["model"]).eval()
    with tempfile.TemporaryDirectory(dir=args.work) as folder:
        export_diffusers(model.state_dict(), copy.deepcopy(config), Path(folder))
        pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True).to(device)
    model = model.to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    side, steps, prompt = s["image"], s["sample_steps"], "a red circle on a white background"

    def ours():
        model.sample([prompt], height=side, width=side, sampler="dpmpp_2m", steps=steps, scale=7.5)

    def theirs():
        pipe(
            prompt,
            height=side,
            width=side,
            num_inference_steps=steps,
            guidance_scale=7.5,
            output_type="pt",
        )

    # Both sides in fp32 weights under fp16 autocast on a GPU (the same treatment), fp32 on a CPU.
    cuda = device.type == "cuda"
    found = {}
    for name, sample in (("ours", ours), ("diffusers", theirs)):
        try:  # one side failing leaves the other its figure
            with torch.no_grad(), torch.autocast(device.type, torch.float16, enabled=cuda):
                found[name] = {"s_per_img": 1 / median_rate(sample, device, 1, 3, 1)}
        except Exception as err:  # noqa: BLE001 - its row says why
            print(f"sampling, {name}: failed: {one_line(err)}", flush=True)
            found[name] = {"error": one_line(err)}
    mine, other = found["ours"], found["diffusers"]
    both = "error" not in mine and "error" not in other
    emit(
        {
            "row": f"sampling {side} px, DPM++ 2M {steps} steps, CFG 7.5: ours",
            **mine,
            "vs_diffusers": other["s_per_img"] / mine["s_per_img"] if both else None,
        }
    )
    emit({"row": "sampling: diffusers", **other})
