"""A progress line for runs that last days: smoothed loss, speed, ETA, LR and peak memory.

In a terminal it redraws one line in place; in a log file (a container, `nohup`, SLURM) it writes
one full line every `log_every_n_steps` optimizer steps instead of a stream of carriage returns.
"""

import math
import sys
import time
from collections.abc import Mapping

import torch
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

from lun.callbacks.measure import batch_size_of, peak_memory_bytes
from lun.callbacks.throughput import Throughput


def format_duration(seconds: float) -> str:
    """`93784` -> `1d 02:03:04`; `?` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    clock = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
    return f"{days}d {clock}" if days else clock


class SmoothedValue:
    """Exponential moving average with bias correction (as Adam's, Kingma & Ba 2015, Alg. 1),
    so the first values are not pulled towards zero. `window` ~ number of recent values that count.

    Values may be tensors on an accelerator: the average then stays there and reading `value`
    is the only host sync, done once per displayed line rather than once per step.
    """

    def __init__(self, window: int):
        self.beta = 1.0 - 1.0 / max(window, 1)
        self.average = None
        self.count = 0

    def update(self, x) -> None:
        self.count += 1
        if isinstance(x, torch.Tensor):
            x = x.detach().float()
        self.average = (
            x * (1 - self.beta)
            if self.average is None
            else self.average * self.beta + x * (1 - self.beta)
        )

    @property
    def value(self) -> float | None:
        if self.count == 0:
            return None
        return float(self.average) / (1 - self.beta**self.count)


class SmoothedProgressBar(ProgressBar):
    """Progress for long training runs (replaces Lightning's tqdm bar).

    Shows: step / total, epoch, smoothed loss, optimizer steps per second, images per second
    across all devices (with the `Throughput` callback its figures, MFU and data wait), ETA,
    learning rate, peak accelerator memory (when there is one), and the values a module logs
    with `prog_bar=True`. Rank 0 only.

    Args:
        log_every_n_steps: in non-interactive runs, one line every this many optimizer steps.
        refresh_every_n_steps: in a terminal, redraw the line every this many optimizer steps,
        refresh_seconds: but not more often than this: a redraw reads the smoothed loss on the
            host, which on an accelerator waits for the device (a sync per step would stop the
            CPU from running ahead).
        smoothing_window: the loss and speed are averaged over about this many recent steps.
        interactive: force terminal (True) or log (False) output; None = terminal when stderr
            is a TTY.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        refresh_every_n_steps: int = 1,
        smoothing_window: int = 50,
        interactive: bool | None = None,
        refresh_seconds: float = 0.5,
    ):
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self.refresh_every_n_steps = refresh_every_n_steps
        self.refresh_seconds = refresh_seconds
        self.smoothing_window = smoothing_window
        self.interactive = interactive
        self._enabled = True
        self._reset_meters()

    def _reset_meters(self) -> None:
        self.loss = SmoothedValue(self.smoothing_window)
        self.step_seconds = SmoothedValue(self.smoothing_window)
        self._last_step_time = None
        self._last_step = None
        self._images_per_step = 0
        self.images_per_step = 0.0
        self._shown_step = None
        self._shown_at = -math.inf  # perf_counter of the last line
        self._line_open = False

    # --- Lightning's ProgressBar interface ---------------------------------------------------
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args, **kwargs) -> None:
        self._end_line()
        print(*args, **kwargs)

    # --- hooks -------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self.interactive is None:
            self.interactive = sys.stderr.isatty()
        self._reset_meters()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._last_step_time is None:
            # Time from the first batch on (not from fit start: setup and sanity checks are not
            # training speed), and again after each validation.
            self._last_step_time = time.perf_counter()
            self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning divides the returned loss by accumulate_grad_batches; show the real one.
            self.loss.update(loss * trainer.accumulate_grad_batches)
        self._images_per_step += batch_size_of(batch) * trainer.world_size
        step = trainer.global_step
        if self._last_step is None or step == self._last_step:
            return  # inside gradient accumulation: not an optimizer step yet
        now = time.perf_counter()
        self.step_seconds.update((now - self._last_step_time) / (step - self._last_step))
        self.images_per_step = self._images_per_step / (step - self._last_step)
        self._last_step_time, self._last_step, self._images_per_step = now, step, 0
        every = self.refresh_every_n_steps if self.interactive else self.log_every_n_steps
        if step % max(every, 1) == 0:
            if not self.interactive or now - self._shown_at >= self.refresh_seconds:
                self._show(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._end_line()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._last_step_time = None  # validation time is not training speed

    def on_train_end(self, trainer, pl_module) -> None:
        if self._last_step is not None and self._shown_step != trainer.global_step:
            self._show(trainer, pl_module)  # the final state, unless just shown
        self._end_line()

    # --- the line ----------------------------------------------------------------------------
    def total_steps(self, trainer) -> float:
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        return trainer.estimated_stepping_batches

    def describe(self, trainer, pl_module) -> str:
        step = trainer.global_step
        total = self.total_steps(trainer)
        parts = [
            f"step {step}/{total if math.isfinite(total) else '?'}",
            f"epoch {trainer.current_epoch}",
        ]
        loss = self.loss.value  # one host read
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        seconds = self.step_seconds.value
        throughput = self._throughput_figures(trainer)
        if seconds:
            parts.append(f"{1 / seconds:.2f} it/s")
            if throughput is None:
                parts.append(f"{self.images_per_step / seconds:.1f} img/s")
        if throughput is not None:  # all ranks' images, MFU, data wait, of the latest window
            parts.append(f"{throughput.images_per_s:.1f} img/s")
            mfu = "?" if throughput.mfu is None else f"{100 * throughput.mfu:.1f}%"
            parts.append(f"mfu {mfu}")
            parts.append(f"wait {100 * throughput.data_wait:.0f}%")
        if seconds:
            parts.append(f"eta {format_duration((total - step) * seconds)}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}")
        peak = peak_memory_bytes(pl_module.device)
        if peak is not None:
            parts.append(f"peak mem {peak / 2**30:.2f} GB")
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name == "v_num":
                continue
            parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
        return " | ".join(parts)

    @staticmethod
    def _throughput_figures(trainer):
        for callback in trainer.callbacks:
            if isinstance(callback, Throughput):
                return callback.latest
        return None

    def _show(self, trainer, pl_module) -> None:
        if not self._enabled:
            return
        self._shown_step, self._shown_at = trainer.global_step, time.perf_counter()
        line = self.describe(trainer, pl_module)
        if self.interactive:
            sys.stderr.write("\r" + line + "\x1b[K")  # \x1b[K clears the rest of a longer old line
            self._line_open = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def _end_line(self) -> None:
        if self._line_open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._line_open = False
