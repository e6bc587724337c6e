"""Crashes and signals during fit: a checkpoint on any exception or Ctrl-C (a second Ctrl-C
exits at once); SIGUSR1 saves `last.ckpt` and training goes on."""

import os
import signal
import threading
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class SignalCheckpoint(Callback):
    """Leave a checkpoint whatever stops a long run.

    - An exception or Ctrl-C during fit: write `dirpath/on_exception.ckpt`, then stop.
    - SIGUSR1 (sent by SLURM before preemption, e.g. `#SBATCH --signal=USR1@120`): write
      `dirpath/last.ckpt` at the end of the current batch and keep training. Handled on every rank
      and agreed on through the strategy, so a signal seen by one rank cannot deadlock DDP.
    - A second Ctrl-C during that shutdown exits at once.

    Args:
        dirpath: folder of `last.ckpt` and `on_exception.ckpt` (the run's `checkpoints/`).
    """

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self._save_requested = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Installed before Lightning's own signal connector, which then leaves SIGUSR1 to us.
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._request_save)

    def _request_save(self, signum, frame) -> None:
        self._save_requested = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.strategy.reduce_boolean_decision(self._save_requested, all=False):
            return
        self._save_requested = False
        path = self.dirpath / "last.ckpt"
        rank_zero_info(f"SIGUSR1: saving {path} at step {trainer.global_step}, training goes on")
        trainer.save_checkpoint(path)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if (
            isinstance(exception, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
        ):
            # Lightning ignores further Ctrl-C while it shuts down; a user pressing it again
            # wants out now, even if that costs the exception checkpoint.
            signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        path = self.dirpath / "on_exception.ckpt"
        rank_zero_info(f"{type(exception).__name__} at step {trainer.global_step}: saving {path}")
        trainer.save_checkpoint(path)
