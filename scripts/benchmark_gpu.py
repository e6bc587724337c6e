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
Each row runs in its own process (clean peak memory; a row that hangs is killed at its time
limit); a failed row prints one line and the run goes on. `--budget-s` skips rows whose
estimate no longer fits. The JSON (`--out`) is rewritten after every row.
"""

import argparse
import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchmark import UNET_PARAMS  # noqa: E402

# bf16 dense tensor-core peaks (vendor data sheets), matched on the CUDA device name in order.
BF16_DENSE_PEAKS = (
    (("H100", "PCIe"), 756.0e12),
    (("H100", "NVL"), 835.5e12),
    (("H100",), 989.5e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (("H200",), 989.5e12),
    (("GH200",), 989.5e12),
    (("A100",), 312.0e12),
    (("L40S",), 362.05e12),
    (("L4",), 121.0e12),
    (("A10G",), 70.0e12),
)

# SD 1.x's UNet: benchmark.py's SD v1 structure at the real width (320).
SD1_UNET = {**UNET_PARAMS, "model_channels": 320}
TINY_UNET = {**SD1_UNET, "model_channels": 32, "channel_mult": [1, 2], "attention_resolutions": [2]}
TINY_VAE = {"ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1}
TINY_TEXT = {"hidden_size": 768, "intermediate_size": 64, "num_hidden_layers": 1}
TINY_TEXT["num_attention_heads"] = 2


def size(tiny: bool) -> dict:
    """The shapes of every row: SD 1.x at 512 px, or tiny for the CPU."""
    if tiny:
        return {
            "unet": TINY_UNET,
            "latent": 8,
            "image": 64,
            "batch": 2,
            "steps": 2,
            "warmup": 1,
            "images": 8,
            "e2e_steps": 4,
            "sample_steps": 2,
            "workers": 0,
        }
    return {
        "unet": SD1_UNET,
        "latent": 64,
        "image": 512,
        "batch": 16,
        "steps": 10,
        "warmup": 3,
        "images": 256,
        "e2e_steps": 18,
        "sample_steps": 20,
        "workers": 8,
    }


def card_peak(name: str) -> float | None:
    """bf16 dense FLOP/s of a card by its name, None when unknown (then no MFU is printed)."""
    for parts, peak in BF16_DENSE_PEAKS:
        if all(part in name for part in parts):
            return peak
    return None


def mfu(flop_per_image: float | None, images_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the card's peak (PaLM, app. B)."""
    if not flop_per_image or not peak:
        return None
    return flop_per_image * images_per_s / peak


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    env["bf16_peak_tflops"] = (card_peak(env["card"]) or 0) / 1e12 or None
    return env


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_rate(step, device, batch: int, steps: int, warmup: int) -> float:
    """Images per second of `step()`: the median of timed steps after `warmup` untimed ones."""
    seconds = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return batch / statistics.median(seconds)


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# --- model rows ---------------------------------------------------------------------------------
def unet_inputs(s: dict, device, channels_last=False, batch=None):
    batch = batch or s["batch"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, s["latent"], s["latent"], generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    context = torch.randn(batch, 77, s["unet"]["context_dim"], generator=g)
    target = torch.randn(x.shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return [v.to(device) for v in (x, t, context, target)]


def train_step(model, optimizer, batch, dtype) -> None:
    from benchmark import forward

    x, t, context, target = batch
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = torch.nn.functional.mse_loss(forward(model, x, t, context).float(), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flop_per_image(model, s, device) -> int:
    """Forward + backward FLOPs of one image (FlopCounterMode; linear in the batch)."""
    from benchmark import step_flops

    flops = step_flops(model.to(device), unet_inputs(s, device, batch=1))
    model.cpu()
    return flops


def model_row(model, s, device, dtype, flop_per_image, peak, channels_last=False, kernels=None):
    """Time one training-step variant of `model` (moved to the device here, freed after)."""
    from torch.nn.attention import sdpa_kernel

    from ldm.optim import build_optimizer

    reset_peak(device)
    model = model.to(device).train()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model.parameters(), lr=1e-5)  # fused AdamW, both sides
    batch = unet_inputs(s, device, channels_last)

    def step():
        if kernels is None:
            return train_step(model, optimizer, batch, dtype)
        with sdpa_kernel(kernels):
            return train_step(model, optimizer, batch, dtype)

    started = time.perf_counter()
    step()  # the first step builds the optimizer state (and compiles, under torch.compile)
    synchronize(device)
    first = time.perf_counter() - started
    rate = median_rate(step, device, s["batch"], s["steps"], s["warmup"])
    row = {
        "img_s": rate,
        "tflop_per_img": flop_per_image / 1e12 if flop_per_image else None,
        "mfu": mfu(flop_per_image, rate, peak),
        "peak_gib": peak_gib(device),
        "first_step_s": first,
    }
    return row  # the model, its optimizer and batch are freed with this frame


def build_ours(s):
    from ldm.util import instantiate_from_config

    torch.manual_seed(0)
    return instantiate_from_config({"target": "ldm.unet.UNetModel", "params": s["unet"]})


def as_diffusers(ours, s):
    """diffusers' UNet2DConditionModel with ours' weights, through diffusers' own converter."""
    from benchmark import original_config
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    from ldm.layout import original

    state = {original.unet_key(k): v for k, v in ours.state_dict().items()}
    config = create_unet_diffusers_config_from_ldm(original_config(s["unet"]), state)
    theirs = UNet2DConditionModel(**config)
    theirs.load_state_dict(convert_ldm_unet_checkpoint(state, config))
    return theirs


def rows_model(args, s, device, emit) -> None:
    from ldm.attention import sdpa_kernels

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = card_peak(environment(device)["card"])
    ours = build_ours(s)  # kept on the CPU; each row moves a copy
    flops = flop_per_image(ours, s, device)

    def variant(**options):
        return lambda: model_row(copy.deepcopy(ours), s, device, dtype, flops, peak, **options)

    attempt(emit, "model: ours", variant())
    attempt(
        emit,
        "model: diffusers",
        lambda: model_row(as_diffusers(ours, s), s, device, dtype, flops, peak),
    )
    attempt(emit, "model: ours + channels_last", variant(channels_last=True))
    # SD 1.x has heads of 40, 80 and 160 channels; cuDNN's kernels stop at 128 (flash takes over
    # there: `attention_kernels: [cudnn, flash]`).
    for kernels in (["cudnn", "flash"], ["flash"]) if device.type == "cuda" else (["math"],):
        label = f"model: ours + {'/'.join(kernels)} attention"
        attempt(emit, label, variant(kernels=sdpa_kernels(kernels)))


def rows_compile(args, s, device, emit, channels_last=False) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = card_peak(environment(device)["card"])
    ours = build_ours(s)
    flops = flop_per_image(ours, s, device)
    # Inductor needs a C++ compiler on the CPU; the tiny CPU row checks the plumbing only.
    options = {} if device.type == "cuda" else {"backend": "eager"}

    def compiled(channels_last):
        model = copy.deepcopy(ours)
        if channels_last:
            model.to(memory_format=torch.channels_last)
        model.compile(**options)
        row = model_row(model, s, device, dtype, flops, peak, channels_last=channels_last)
        return {**row, "note": f"compile + first step {row['first_step_s']:.0f} s"}

    label = "model: ours + torch.compile" + (" + channels_last" if channels_last else "")
    attempt(emit, label, lambda: compiled(channels_last))


def rows_compile_channels_last(args, s, device, emit) -> None:
    rows_compile(args, s, device, emit, channels_last=True)


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
                    "target": "benchmark_gpu.StepTimer",
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


def attempt(emit, label: str, measure) -> None:
    """Emit `measure()`'s figures as row `label`, or its failure in one line."""
    try:
        emit({"row": label, **measure()})
    except Exception as err:  # noqa: BLE001 - one line, the other rows go on
        print(f"{label}: failed: {one_line(err)}", flush=True)
        emit({"row": label, "error": one_line(err)})


# --- loop, demo, sampling -----------------------------------------------------------------------
def rows_loop(args, s, device, emit) -> None:
    script = ROOT / "scripts" / "benchmark_loop.py"
    if not script.exists():
        emit({"row": "loop", "skipped": "scripts/benchmark_loop.py is not there"})
        return
    where = ["--device", "cuda"] if device.type == "cuda" else []
    out = python([sys.executable, str(script), *where], timeout=args.row_timeout)
    emit({"row": "loop (scripts/benchmark_loop.py)", "output": tail(out, 12)})


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
    from benchmark import original_config
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
    with torch.no_grad(), torch.autocast(device.type, torch.float16, enabled=cuda):
        rate_ours = median_rate(ours, device, 1, 3, 1)
        rate_theirs = median_rate(theirs, device, 1, 3, 1)
    emit(
        {
            "row": f"sampling {side} px, DPM++ 2M {steps} steps, CFG 7.5: ours",
            "s_per_img": 1 / rate_ours,
            "vs_diffusers": rate_ours / rate_theirs,
        }
    )
    emit({"row": "sampling: diffusers", "s_per_img": 1 / rate_theirs})


# --- the driver ---------------------------------------------------------------------------------
# name -> (function, estimated seconds on an H100, most seconds it may take)
# In this order: what issue 30 measures first. A row group that passes its limit is killed;
# its rows finished by then are kept.
ROWS = {
    "model": (rows_model, 60, 150),
    "e2e": (rows_e2e, 120, 220),
    "demo": (rows_demo, 120, 240),
    "compile": (rows_compile, 100, 240),
    "e2e_no_ema": (rows_e2e_no_ema, 50, 100),
    "sampling": (rows_sampling, 50, 120),
    "compile_channels_last": (rows_compile_channels_last, 100, 240),
    "loop": (rows_loop, 30, 90),
}
TINY_LIMIT = 900  # seconds per row group at --tiny (no budget: a loaded CPU is slow)


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    last = text[-1] if text else ""
    return f"{type(err).__name__}: {last if len(last) < 300 else '...' + last[-280:]}"


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def python(cmd, timeout: float, on_line=None, new_session=False) -> str:
    """Run a command from the project root and return its output; past `timeout` seconds it is
    killed with its process group (in a new group when `new_session`: a row and all it
    started)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    process = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=new_session,
    )
    killed = threading.Event()

    def kill():
        killed.set()
        try:
            os.killpg(process.pid, signal.SIGKILL) if new_session else process.kill()
        except ProcessLookupError:
            pass

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if on_line:
                on_line(line)
        process.wait()
    finally:
        watchdog.cancel()
    if killed.is_set():
        raise TimeoutError(f"{Path(cmd[1]).name} did not finish in {timeout:.0f} s (killed)")
    out = "".join(lines)
    if process.returncode != 0:
        raise RuntimeError(f"{Path(cmd[1]).name} exit {process.returncode}: {tail(out)}")
    return out


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
