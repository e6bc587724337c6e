"""Per-epoch wall time, throughput and peak accelerator memory (the original `CUDACallback`)."""

import time

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lun.callbacks.measure import batch_size_of, peak_memory_bytes, reset_peak_memory
from lun.callbacks.throughput import Throughput


class EpochStats(Callback):
    """Log `epoch/time_s`, `epoch/images_per_s` and (on accelerators) `epoch/peak_memory_gb`.

    Over ranks, the slowest rank's time and throughput and the fullest rank's memory are
    logged, logged at each training epoch end and printed as one line. Peak memory is reset at
    each epoch start, so the progress bar's "peak mem" is the peak of the current epoch. With
    the `Throughput` callback the line also says the epoch's MFU and data-wait fraction.
    """

    def __init__(self):
        self._start: float | None = None
        self._images = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        reset_peak_memory(pl_module.device)
        self._start = time.perf_counter()
        self._images = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._images += batch_size_of(batch) * trainer.world_size

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._start is None:
            return
        seconds = time.perf_counter() - self._start
        stats = {"epoch/time_s": seconds, "epoch/images_per_s": self._images / max(seconds, 1e-9)}
        peak = peak_memory_bytes(pl_module.device)
        if peak is not None:
            stats["epoch/peak_memory_gb"] = peak / 2**30
        for name, value in stats.items():
            slowest = "min" if name == "epoch/images_per_s" else "max"
            pl_module.log(
                name, value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx=slowest
            )
        memory = f", peak memory {stats['epoch/peak_memory_gb']:.2f} GB" if peak is not None else ""
        throughput = ""
        for callback in trainer.callbacks:
            if isinstance(callback, Throughput):  # a collective: every rank gets here
                figures = callback.epoch_figures(trainer, pl_module)
                throughput = ", " + callback.summary(figures) if figures is not None else ""
        rank_zero_info(
            f"epoch {trainer.current_epoch}: {seconds:.1f} s, "
            f"{stats['epoch/images_per_s']:.1f} images/s{memory}{throughput}"
        )
