"""Throughput in every run: images/s, model FLOPs per image, MFU, data-wait fraction, peak memory.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", appendix B) is the FLOP/s the
training step achieves divided by what the devices could do at peak. The FLOPs are counted, not
estimated: the first micro-batch of each input shape (aspect buckets give several) runs under
`FlopCounter`, which counts every matmul, convolution and attention of its forward and backward
pass with the formulas of `torch.utils.flop_counter` - the backbone, and also the VAE encode and
text encoder when they run in the step. (With gradient checkpointing the recomputed forward is counted too, so the
figure is then hardware FLOPs utilisation.) The peak comes from the vendor datasheets below, or,
on a CPU or an unknown device, from a matmul probe timed once per process. MFU is never shown
above 100 %: a probe that reads low (other processes on the same cores) is taken again and the
best of the probes counts; a window that still runs faster than the peak says "unknown".

Data wait is the time from the moment the training loop asks for the next batch to the moment
the step starts (loading, collating, host -> device copy): what other callbacks do after a step
(the EMA, checkpoints) is not data wait.
"""

import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lun.callbacks.measure import batch_size_of, peak_memory_bytes

# Dense peak TFLOP/s per device (without 2:4 sparsity, which datasheets mark with *), tensor
# cores with fp32 accumulation, as PyTorch runs them. Sources: NVIDIA A100 datasheet (2021);
# H100 datasheet (2023; SXM, NVL) and H100 PCIe product brief; H200 datasheet (2024; SXM, NVL);
# L40S datasheet (2023); Ada Lovelace whitepaper v1.1, appendix A (RTX 4090); Ampere GA102
# whitepaper, table 9 (RTX 3090); L4 and A10 datasheets; AMD Instinct MI250X and MI300X
# datasheets. PyTorch sees each of an MI250X's two dies (GCDs) as one device: half the card.
# The first pattern that matches the device name wins, so the specific ones come first.
PEAK_TFLOPS = [
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H[12]00 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H[12]00", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"RTX 4090(?! D)", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090(?! Ti)", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"MI250X?", {"bf16": 191.5, "fp16": 191.5, "fp32": 47.85}),
    (r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
DTYPES |= {"fp32": torch.float32, "fp64": torch.float64}

_MEASURED_PEAKS: dict[tuple[str, torch.dtype], float] = {}  # one probe per process


def training_dtype(precision: str) -> str:
    """The dtype the matmuls of a run at Lightning `precision` use: bf16, fp16, tf32, fp32, fp64."""
    name = str(precision)
    if name.startswith("bf16"):
        return "bf16"
    if name.startswith("16"):
        return "fp16"
    if name.startswith("64"):
        return "fp64"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def table_peak_flops(device_name: str, dtype: str) -> float | None:
    """Datasheet peak FLOP/s of a device by its name, or None when the table does not know it."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


def _step_ends_at_backward(pl_module) -> bool:
    """Whether a training step's counted work ends with its backward: true under Lightning's
    automatic optimization (one backward per step); a manually optimised module (the VAE's
    generator and discriminator updates) may run more after a backward, so it is counted to the
    end of the batch (the model contract's `steps_own_optimizers`)."""
    return not pl_module.steps_own_optimizers


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measured_matmul_flops(
    device: torch.device, dtype: torch.dtype, budget_s: float = 0.1, again: bool = False
) -> float:
    """FLOP/s of square matmuls on `device` in `dtype`, measured once per process.

    The side doubles (from 512) while one product takes under a tenth of the budget, so slow
    kinds (bf16 on a CPU without bf16 units) stay cheap; the best of the timed runs counts.
    Other processes busy on the same cores make it read low (and the MFU high).
    Random numbers come from a generator of its own: the run's streams stay as they were.
    `again`: probe once more and keep the best of all probes (a peak is a maximum).
    """
    key = (str(device), dtype)
    if key in _MEASURED_PEAKS and not again:
        return _MEASURED_PEAKS[key]
    generator = torch.Generator(device).manual_seed(0)
    largest = 1024 if device.type == "cpu" else 8192

    def product_seconds(a, b) -> float:
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        return time.perf_counter() - start

    n = 512
    while True:
        a, b = (torch.randn(n, n, device=device, generator=generator).to(dtype) for _ in "ab")
        seconds = product_seconds(a, b)  # the first one also warms up the kernels
        if n >= largest or seconds > budget_s / 10:
            break
        n *= 2
    best, spent = product_seconds(a, b), 0.0
    while spent < budget_s:
        seconds = product_seconds(a, b)
        best, spent = min(best, seconds), spent + seconds
    _MEASURED_PEAKS[key] = max(2 * n**3 / best, _MEASURED_PEAKS.get(key, 0.0))
    return _MEASURED_PEAKS[key]


def device_peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, where the figure comes from)."""
    if device.type != "cpu":
        module = torch.get_device_module(device)
        name = module.get_device_name(device) if hasattr(module, "get_device_name") else ""
        peak = table_peak_flops(name, dtype)
        if peak is not None:
            return peak, f"{name}, {dtype}, datasheet"
    measured = measured_matmul_flops(device, DTYPES.get(dtype, torch.float32))
    return measured, f"{device.type}, {dtype}, measured matmul"


class FlopCounter(TorchDispatchMode):
    """FLOPs of the ops run under it, by `torch.utils.flop_counter`'s formulas (those of
    `FlopCounterMode`, which gives the same totals). Every op runs exactly as called:
    FlopCounterMode decomposes the ops it has no formula for (`silu_backward`, ...) into others,
    which changes the step's rounding - and a resumed run, whose first step is counted, would
    no longer be bitwise the same as an unbroken one."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def process_peak_rss() -> int:
    """The largest resident set this process has had, in bytes."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return getattr(info, "peak_wset", info.rss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_memory(device: torch.device) -> int:
    """The accelerator allocator's peak since its last reset, or the process's peak RSS on CPU."""
    peak = peak_memory_bytes(device)
    return process_peak_rss() if peak is None else peak


def shape_key(batch) -> tuple:
    """The per-sample shapes of a batch's tensors: ((name, shape), ...). Batches of one key
    cost the same FLOPs per image; the captions' lengths do not matter (tokens are padded)."""
    if isinstance(batch, torch.Tensor):
        return (("input", tuple(batch.shape[1:])),)
    if not isinstance(batch, (Mapping, Sequence)):
        return ()
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
    return tuple(
        (str(name), tuple(v.shape[1:]))
        for name, v in items
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def describe_shape(key: tuple) -> str:
    """`image 3x512x512`: the batch's per-sample images, latents and cached conditioning. Its
    vectors (SDXL's size and crop tensors, which the data writes for every model, labels, loss
    weights) are left out: what they hold, not their length, differs between batches."""
    shown = [(name, shape) for name, shape in key if len(shape) >= 2] or list(key)
    return ", ".join(" ".join([name, "x".join(map(str, shape))]).strip() for name, shape in shown)


def format_mfu(mfu: float | None) -> str:
    """`38.2 %`, or `unknown` when the step ran faster than the known peak."""
    return "unknown" if mfu is None else f"{100 * mfu:.1f} %"


def format_flops(flops: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


@dataclass
class Tally:
    """What one rank measured over some micro-batches (those under the FLOP counter left out)."""

    images: float = 0.0
    flops: float = 0.0
    wait_s: float = 0.0  # from asking for the next batch to the start of its step
    busy_s: float = 0.0  # from on_train_batch_start to on_train_batch_end
    other_s: float = 0.0  # the rest between steps: other callbacks' work after a step

    def values(self) -> list[float]:
        return [self.images, self.flops, self.wait_s, self.busy_s, self.other_s]


@dataclass
class Figures:
    """The figures of a window of steps, over all ranks."""

    step: int
    images: float  # all ranks together
    images_per_s: float
    flops_per_s: float  # all ranks together
    mfu: float | None  # None: unknown (the step ran faster than the peak we know)
    data_wait: float  # fraction of the step time
    peak_memory: int  # bytes, the fullest rank
    seconds: float  # mean over ranks
    warmup: bool


class Throughput(Callback):
    """Images/s, MFU, data-wait fraction and peak memory: progress bar, TensorBoard, epoch line,
    and a short throughput report at the end of training.

    Every `log_every_n_steps` optimizer steps the ranks' tallies are gathered (one collective)
    and logged as `throughput/img_per_s` (all ranks), `throughput/mfu`, `throughput/data_wait`
    (fraction of step time spent between steps, mostly waiting for the next batch and its
    transfer; also what other callbacks do after a step) and `throughput/peak_mem_gb`.

    Args:
        log_every_n_steps: optimizer steps per window; None = the trainer's `log_every_n_steps`.
        warmup_steps: the first optimizer steps (start-up, compilation, allocator growth) are
            left out of the end-of-run report; all steps count when the run is shorter.
        peak_flops: peak FLOP/s of one device, for a device the built-in table does not know
            (None = the table, or a measured matmul probe).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 10,
        peak_flops: float | None = None,
    ):
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.peak_source = "given"
        self.flops_per_image: dict[tuple, float] = {}
        self.windows: list[Figures] = []
        self.latest: Figures | None = None
        self.run_peak_memory = 0
        self._counter: FlopCounter | None = None
        self._counted_flops = 0.0
        self._start_step = 0
        self.memory_kind = ""
        self._epoch_figures: tuple[int, Figures | None] | None = None
        self._reset_timing()

    def _reset_timing(self) -> None:
        self._window, self._epoch = Tally(), Tally()
        self._last_end = self._start = self._key = None
        self._fetch_started: float | None = None
        self._wait = self._other = 0.0
        self._last_step = None
        self._window_from = 0  # the step the current window started after

    # --- hooks -------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._reset_timing()
        self._last_step = self._start_step = self._window_from = trainer.global_step
        cpu = pl_module.device.type == "cpu"
        self.memory_kind = "process peak RSS" if cpu else "accelerator allocator peak"
        if self.peak_flops is None or self.peak_source != "given":
            dtype = training_dtype(trainer.precision)
            self.peak_flops, self.peak_source = device_peak_flops(pl_module.device, dtype)

    def _clock_the_fetch(self, trainer) -> None:
        """Note when the training loop starts fetching a batch: Lightning's data fetcher calls
        `_start_profiler` right then (re-set at each epoch start, so wrapped again)."""
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        original = getattr(fetcher, "_start_profiler", None)
        if original is None or getattr(original, "lun_throughput", False):
            return

        def fetch_starts() -> None:
            self._fetch_started = time.perf_counter()
            original()

        fetch_starts.lun_throughput = True
        fetcher._start_profiler = fetch_starts

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._wait = self._other = 0.0
        if self._last_end is None:
            pass
        elif self._fetch_started is not None and self._fetch_started >= self._last_end:
            self._wait = now - self._fetch_started  # only the wait for this batch
            self._other = self._fetch_started - self._last_end  # counts as time, not as wait
        else:  # the first batch of an epoch: fetched before the clock was wrapped again
            self._wait = now - self._last_end
        self._fetch_started = None
        self._clock_the_fetch(trainer)
        self._key = shape_key(batch)
        if self._key not in self.flops_per_image:
            # This micro-batch's forward and backward are counted (and left out of the timing).
            self._counter = FlopCounter()
            self._counter.__enter__()
        self._start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module) -> None:
        if _step_ends_at_backward(pl_module):
            self._stop_counting()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._key not in self.flops_per_image:
            self._stop_counting()
            self.flops_per_image[self._key] = self._counted_flops / max(batch_size_of(batch), 1)
        elif self._start is not None:
            images = batch_size_of(batch)
            for tally in (self._window, self._epoch):
                tally.images += images
                tally.flops += images * self.flops_per_image[self._key]
                tally.wait_s += self._wait
                tally.other_s += self._other
                tally.busy_s += now - self._start
        self._last_end = time.perf_counter()
        step = trainer.global_step
        if step == self._last_step:
            return  # inside gradient accumulation
        every = self.log_every_n_steps or max(trainer.log_every_n_steps, 1)
        last, self._last_step = self._last_step, step
        warmup_end = self._start_step + self.warmup_steps
        if step // every > last // every or last < warmup_end <= step:
            self._close_window(trainer, pl_module, warmup=step <= warmup_end)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last_end = None  # validation time is no data wait

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop_counting()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._stop_counting()  # a callback may have ended the epoch inside a batch
        self.epoch_figures(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        # The last, partial window: decided by the step, which every rank shares, not by this
        # rank's own timing - the figures are a collective, and a rank whose last steps were all
        # FLOP-counted (a new bucket shape) timed nothing while the others did.
        if trainer.global_step > self._window_from:
            warmup = trainer.global_step <= self._start_step + self.warmup_steps
            self._close_window(trainer, pl_module, warmup)
        rank_zero_info(self.report(trainer.world_size, str(trainer.precision)))

    # --- figures -----------------------------------------------------------------------------
    def _stop_counting(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counted_flops = float(self._counter.flops)
            self._counter = None

    def _figures(self, trainer, pl_module, tally: Tally, warmup: bool) -> Figures | None:
        """The figures of every rank's `tally` (a collective: all ranks call it at one step)."""
        self.run_peak_memory = max(self.run_peak_memory, peak_memory(pl_module.device))
        ranks = [[*tally.values(), float(self.run_peak_memory)]]  # host numbers: no sync
        if trainer.world_size > 1:  # one collective, then one read
            local = torch.tensor(ranks[0], device=pl_module.device)
            ranks = trainer.strategy.all_gather(local).double().cpu().tolist()
        seconds = [wait + busy + other for _, _, wait, busy, other, _ in ranks]
        if min(seconds) <= 0:
            return None  # a rank timed nothing (all its micro-batches were counted)
        flops_per_s = sum(r[1] / s for r, s in zip(ranks, seconds, strict=True))
        return Figures(
            step=trainer.global_step,
            images=sum(r[0] for r in ranks),
            images_per_s=sum(r[0] / s for r, s in zip(ranks, seconds, strict=True)),
            flops_per_s=flops_per_s,
            mfu=self._mfu(pl_module, flops_per_s / len(ranks), trainer),
            data_wait=sum(r[2] / s for r, s in zip(ranks, seconds, strict=True)) / len(ranks),
            peak_memory=int(max(r[5] for r in ranks)),
            seconds=sum(seconds) / len(ranks),
            warmup=warmup,
        )

    def _mfu(self, pl_module, flops_per_s: float, trainer) -> float | None:
        """Achieved / peak FLOP/s of one device, or None rather than a figure above 100 %."""
        if flops_per_s > self.peak_flops and self.peak_source.endswith("measured matmul"):
            # The probe read low (a loaded CPU): probe again, keep the best of the probes.
            dtype = DTYPES.get(training_dtype(trainer.precision), torch.float32)
            self.peak_flops = measured_matmul_flops(pl_module.device, dtype, again=True)
        mfu = flops_per_s / self.peak_flops
        return mfu if mfu <= 1.0 else None

    def _close_window(self, trainer, pl_module, warmup: bool) -> None:
        figures = self._figures(trainer, pl_module, self._window, warmup)
        self._window, self._window_from = Tally(), trainer.global_step
        if figures is None:
            return
        self.windows.append(figures)
        self.latest = figures
        metrics = {
            "throughput/img_per_s": figures.images_per_s,
            "throughput/data_wait": figures.data_wait,
            "throughput/peak_mem_gb": figures.peak_memory / 2**30,
        }
        if figures.mfu is not None:
            metrics["throughput/mfu"] = figures.mfu
        for each in trainer.loggers:
            each.log_metrics(metrics, step=trainer.global_step)

    def epoch_figures(self, trainer, pl_module) -> Figures | None:
        """This epoch's figures; the first call at an epoch end gathers them (all ranks call)."""
        epoch = trainer.current_epoch
        if self._epoch_figures is None or self._epoch_figures[0] != epoch:
            figures = self._figures(trainer, pl_module, self._epoch, warmup=False)
            self._epoch_figures, self._epoch = (epoch, figures), Tally()
        return self._epoch_figures[1]

    @staticmethod
    def summary(figures: Figures) -> str:
        """`MFU 38.2 %, data wait 3.1 %` (for the epoch line)."""
        return f"MFU {format_mfu(figures.mfu)}, data wait {100 * figures.data_wait:.1f} %"

    def report(self, world_size: int = 1, precision: str = "") -> str:
        """The end-of-run report: a few lines over the windows after the warm-up."""
        timed = [w for w in self.windows if not w.warmup]
        span = f"steps {self._start_step + self.warmup_steps + 1}-"
        if not timed:  # a run shorter than the warm-up: all its steps count
            timed, span = self.windows, f"no steps after the warm-up, steps {self._start_step + 1}-"
        devices = f"{world_size} device{'s' * (world_size > 1)}" + (
            f", {precision}" * bool(precision)
        )
        lines = ["throughput report:"]
        if timed:
            total = sum(w.seconds for w in timed)

            def mean(name: str) -> float:  # weighted by time: all images / all time
                return sum(getattr(w, name) * w.seconds for w in timed) / total

            known = [w for w in timed if w.mfu is not None]
            mfu = (
                sum(w.mfu * w.seconds for w in known) / sum(w.seconds for w in known)
                if known
                else None
            )
            median = statistics.median(w.images_per_s for w in timed)
            lines += [
                f"  {span}{timed[-1].step}, {devices}",
                f"  images/s: {mean('images_per_s'):.1f} mean, {median:.1f} median of "
                f"{len(timed)} window{'s' * (len(timed) > 1)} (all devices together)",
                f"  MFU: {format_mfu(mfu)} of {format_flops(self.peak_flops)}/s per "
                f"device ({self.peak_source})",
                f"  data wait: {100 * mean('data_wait'):.1f} % of the step time",
            ]
        else:
            lines.append("  no step was timed (each was the first of its input shape)")
        lines.append(f"  peak memory: {self.run_peak_memory / 2**30:.2f} GB ({self.memory_kind})")
        for key, flops in self.flops_per_image.items():
            lines.append(f"  FLOPs per image, {describe_shape(key)}: {format_flops(flops)}")
        return "\n".join(lines)
