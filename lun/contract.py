"""What `lun` (callbacks, the launcher, scripts) may use of a LightningModule - and nothing else.

A model family (latent diffusion with a UNet or a DiT, the autoencoder) plugs into the trainer by
satisfying this protocol; `tests/lun/test_contract.py` checks that every module does. The
learning rate is no attribute the launcher patches: it writes `base_learning_rate` (scaled
with `--scale_lr`) into the config's `params.learning_rate` before the module is built.
"""

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TrainableModule(Protocol):
    """The contract between `lun` and a LightningModule it trains.

    ema_module: the module whose trainable weights the EMA callback averages (a submodule, or a
        view of the module's own parts); the shadows' keys are `ldm.layout.ema.ema_key(name)`.
    log_images(batch, N, prompts, seed, sampler, steps, scale, **kwargs): images for the image
        logger, a dict of (N, 3, H, W) tensors in [-1, 1].
    latent_shape(height, width): (C, h, w) of the latent of an image of that size (raises
        ValueError naming the size multiple when it does not fit).
    default_image_size: the image side the model samples at when none is given.
    """

    ema_module: nn.Module
    default_image_size: int

    def log_images(self, batch=None, N: int = 4, **kwargs) -> dict[str, torch.Tensor]: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]: ...
