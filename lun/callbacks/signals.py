"""Crashes and signals during fit: a checkpoint on any exception, Ctrl-C or SIGTERM (a second
Ctrl-C exits at once), and the exit status that says why; SIGUSR1 saves `last.ckpt` and training
goes on."""

import os
import signal
import threading
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lun.run import take_held_save_signal

# The shell's convention for a process ended by a signal: 128 + its number.
EXIT_CTRL_C = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


def exit_status(stop: SystemExit) -> int | None:
    """The exit status for a `SystemExit` out of `Trainer.fit`: Lightning stops on SIGTERM with a
    bare `SIGTERMException` (status 0) and on Ctrl-C with `sys.exit(1)`, so a scheduler or a
    script could not tell a stopped run from a finished one. None: not a stop we know."""
    if isinstance(stop, SIGTERMException):
        return EXIT_SIGTERM
    if isinstance(stop.__context__, KeyboardInterrupt):  # raised while handling it
        return EXIT_CTRL_C
    return None


class SignalCheckpoint(Callback):
    """Leave a checkpoint whatever stops a long run.

    - An exception or Ctrl-C during fit: write `dirpath/on_exception.ckpt`, then stop (not
      before the first optimizer step: there is nothing new to save then).
    - SIGTERM: the same `on_exception.ckpt` (Lightning stops at the end of the batch).
    - SIGUSR1 (sent by SLURM before preemption, e.g. `#SBATCH --signal=USR1@120`): write
      `dirpath/last.ckpt` at the end of the current batch and keep training. Handled on every rank
      and agreed on through the strategy, so a signal seen by one rank cannot deadlock DDP. One
      that came during start-up (held by `lun.run.hold_save_signal`) saves after the first step.
      With several processes agreeing is a collective and a host read (a device sync), so they
      agree every `agree_every` optimizer steps only: the save comes at the next such step.
    - A second Ctrl-C during that shutdown exits at once.

    Args:
        dirpath: folder of `last.ckpt` and `on_exception.ckpt` (the run's `checkpoints/`).
        agree_every: with several processes, agree on a SIGUSR1 every this many optimizer steps;
            None = the trainer's `log_every_n_steps` (steps that sync anyway). Lower it when the
            signal's grace time is shorter than that many steps.
    """

    def __init__(self, dirpath: str, agree_every: int | None = None):
        if agree_every is not None and agree_every < 1:
            raise ValueError(f"SignalCheckpoint agree_every must be >= 1, got {agree_every}")
        self.dirpath = Path(dirpath)
        self.agree_every = agree_every
        self._agreed_at: int | None = None  # the optimizer step of the last agreement
        self._save_requested = False
        self._start_step: int | None = None  # the step this fit started from

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Installed before Lightning's own signal connector, which then leaves SIGUSR1 to us.
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._request_save)
        if take_held_save_signal():  # after the handler is in place: none is lost in between
            rank_zero_info("SIGUSR1 came during start-up: saving last.ckpt after the first step")
            self._save_requested = True

    def _request_save(self, signum, frame) -> None:
        self._save_requested = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size == 1:
            requested = self._save_requested  # nothing to agree on: no tensor, no sync
        else:
            step, every = trainer.global_step, self.agree_every or trainer.log_every_n_steps
            if step % max(every, 1) or step == self._agreed_at:
                return
            self._agreed_at = step
            requested = trainer.strategy.reduce_boolean_decision(self._save_requested, all=False)
        if not requested:
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
        name, step = type(exception).__name__, trainer.global_step
        if self._start_step is None or step == self._start_step:
            # Nothing trained yet: the weights are those this run started from, and a resume that
            # fails in set-up would replace the newer on_exception.ckpt it resumed from.
            rank_zero_info(f"{name} before the first training step: {path} not written")
            return
        rank_zero_info(f"{name} at step {step}: saving {path}")
        trainer.save_checkpoint(path)
