"""How scripts/benchmark_gpu.py takes a figure: the shapes of its rows, the card's peak and
MFU, the median step rate, peak memory, and running a command (one row group, main.py, a script)
with a time limit and one line when it fails."""

import gc
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_common import UNET_PARAMS  # noqa: E402

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
    """Start a peak at what is live now. The previous row's garbage goes first: the blocks of a
    model under block swap are a reference cycle (their forwards hold the swap, which holds
    them) that only the cycle collector frees, and a peak starts from the memory still held."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


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
    except BaseException:
        kill()  # reading its output failed: it must not go on holding the device
        process.wait()
        raise
    finally:
        watchdog.cancel()
    if killed.is_set():
        raise TimeoutError(f"{Path(cmd[1]).name} did not finish in {timeout:.0f} s (killed)")
    out = "".join(lines)
    if process.returncode != 0:
        raise RuntimeError(f"{Path(cmd[1]).name} exit {process.returncode}: {tail(out)}")
    return out


def attempt(emit, label: str, measure) -> None:
    """Emit `measure()`'s figures as row `label`, or its failure in one line."""
    try:
        emit({"row": label, **measure()})
    except Exception as err:  # noqa: BLE001 - one line, the other rows go on
        print(f"{label}: failed: {one_line(err)}", flush=True)
        emit({"row": label, "error": one_line(err)})
