"""Allocator refusals on purpose, for the out-of-memory tests: each asks torch's real CPU
allocator for 4 EiB, which no machine gives (nothing is allocated; the error is the real one)."""

import torch
from lightning.pytorch.callbacks import Callback

from ldm.autoencoder import AutoencoderKL


def refused_allocation() -> None:
    torch.empty(2**62, dtype=torch.uint8)


class SmallMemoryVAE(AutoencoderKL):
    """The autoencoder on a machine that holds images up to `max_pixels`: a larger one's encode
    fails in the allocator, as the VAE's attention on a large image does on a small machine."""

    def __init__(self, max_pixels: int, **params):
        super().__init__(**params)
        self.max_pixels = max_pixels

    def encode(self, x: torch.Tensor):
        if x.shape[-2] * x.shape[-1] > self.max_pixels:
            refused_allocation()
        return super().encode(x)


class RefuseAllocationAtStep(Callback):
    """At `step`'s start (a training step), ask the allocator for what it cannot give."""

    def __init__(self, step: int = 0):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            refused_allocation()
