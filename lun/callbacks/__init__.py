"""Training callbacks, one per file; `defaults.default_callback_configs` lists the default set.

- `ema.EMA` (+ `ema.ema_weights` context): EMA of the UNet weights in CPU memory.
- `progress.SmoothedProgressBar`: smoothed loss, it/s, images/s, ETA, LR, peak memory.
- `image_logger.ImageLogger`: sample grids with fixed prompts/seeds -> PNG + TensorBoard.
- `checkpoints.Checkpoint`: ModelCheckpoint + `save_every_n_samples` and self-explaining names.
- `nan_guard.NaNGuard`: skip NaN/inf steps, stop with a last-good checkpoint.
- `epoch_stats.EpochStats`: time, throughput and peak memory per epoch.
- `rng_state.RNGState`: every rank's random-number streams in each checkpoint, for exact resume.
Checkpoint files are written atomically by `lun.atomic_io.AtomicCheckpointIO`.
"""

from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.defaults import default_callback_configs
from lun.callbacks.ema import EMA, ema_weights
from lun.callbacks.epoch_stats import EpochStats
from lun.callbacks.image_logger import ImageLogger, make_grid
from lun.callbacks.nan_guard import NaNGuard, NonFiniteLossError
from lun.callbacks.progress import SmoothedProgressBar

__all__ = [
    "EMA",
    "Checkpoint",
    "EpochStats",
    "ImageLogger",
    "NaNGuard",
    "NonFiniteLossError",
    "SmoothedProgressBar",
    "default_callback_configs",
    "ema_weights",
    "make_grid",
]
