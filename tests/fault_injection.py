"""A callback that makes things go wrong on purpose, for the launcher's crash/signal tests."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class FaultInjection(Callback):
    """At `signal_at_step` send this process SIGUSR1; at `raise_at_step` raise RuntimeError."""

    def __init__(self, raise_at_step: int | None = None, signal_at_step: int | None = None):
        self.raise_at_step, self.signal_at_step = raise_at_step, signal_at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.signal_at_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if trainer.global_step == self.raise_at_step:
            raise RuntimeError(f"injected failure at step {trainer.global_step}")
