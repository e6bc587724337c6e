"""What `lun` (callbacks, the launcher, the data cache, generation, scripts) may use of a
LightningModule - and nothing else.

A model family (latent diffusion with a UNet, a DiT or an MMDiT, the autoencoder) plugs into the
trainer by satisfying these protocols; `ldm/model_contract.py` implements them as mixins and
`tests/lun/test_contract.py` checks that every module does, and that lun and the scripts read
no model part (`first_stage_model`, `conditioner`, `backbone`, `scale_factor`, ...) directly.
The learning rate is no attribute the launcher patches: it writes `base_learning_rate` (scaled
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
    steps_own_optimizers: its optimisation mode - True when `training_step` steps the
        optimizers itself (the VAE's GAN): no step without a trainer, no one backward per batch.
    gradient_checkpointing / set_gradient_checkpointing(enabled): activation recomputation of
        the trained network (None: it has none; setting it on then raises ValueError).
    strategy_problem(strategy, find_unused_parameters, resuming): why the module cannot train
        under `lun.strategies.strategy_kind`'s "ddp" / "deepspeed" / "fsdp" / "model_parallel" /
        "single" (one line naming the key), or None.
    strategy_casts_parameters: set by lun before fit (`lun.run.check_strategy_fits`, from
        `lun.strategies.casts_parameters`): the strategy holds the parameters in its own form
        and dtype (FSDP, DeepSpeed), so the module's training mode leaves their dtype alone.
    """

    ema_module: nn.Module
    default_image_size: int
    steps_own_optimizers: bool
    gradient_checkpointing: bool | None
    strategy_casts_parameters: bool

    def log_images(self, batch=None, N: int = 4, **kwargs) -> dict[str, torch.Tensor]: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]: ...

    def set_gradient_checkpointing(self, enabled: bool) -> None: ...

    def strategy_problem(
        self, strategy: str, find_unused_parameters: bool = False, resuming: bool = False
    ) -> str | None: ...


@runtime_checkable
class LatentModel(TrainableModule, Protocol):
    """A latent diffusion model, as the latent cache, generation and the scripts use it.

    first_stage_moments(images): the VAE posterior's (mean, logvar) as (B, 2C, h, w), float32,
        in the VAE's units (what a latent cache stores).
    to_model_latents(z): a first-stage latent -> the backbone's: (z - shift) * scale.
    encode_latents(images, generator): images -> model latents (one posterior sample).
    encoders_to(device): the first stage and conditioner to `device` (not the backbone).
    load_first_stage(path, what): swap the VAE's weights for the file's (strict).
    encode_captions(captions): `{field: (B, ...)}` conditioning of captions, none dropped.
    caption_conditioning_frozen: whether a caption's conditioning is fixed (cacheable).
    class_count: the number of classes of a class-conditional model, None for a text model.
    cache_fingerprint(text): what cached latents (and cached text, with `text`) depend on.
    guidance_distilled: distilled not to need classifier-free guidance (Flux): scale 1 by default.
    embedded_guidance: the guidance value such a model takes as an input (Flux dev), settable;
        None when it takes none.
    max_latent_side: the largest latent side the backbone takes (a position table), None: any.

    For the scripts that write a part in another tool's layout or time it against that tool's
    (training never needs them):
    latent_scaling: (scale, shift) of the latents, diffusers' VAE `scaling_factor` and
        `shift_factor`.
    denoiser: the denoising network alone (UNet, DiT, MMDiT).
    caption_conditioner: the module that turns captions into conditioning, with its text
        encoders and tokenizers.
    """

    class_count: int | None
    caption_conditioning_frozen: bool
    guidance_distilled: bool
    embedded_guidance: float | None
    max_latent_side: int | None
    latent_scaling: tuple[float, float]
    denoiser: nn.Module
    caption_conditioner: nn.Module

    def first_stage_moments(self, images: torch.Tensor) -> torch.Tensor: ...

    def to_model_latents(self, z: torch.Tensor) -> torch.Tensor: ...

    def encode_latents(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor: ...

    def encoders_to(self, device: torch.device | str) -> None: ...

    def load_first_stage(self, path: str, what: str = "--vae") -> None: ...

    def encode_captions(self, captions: list[str]) -> dict[str, torch.Tensor]: ...

    def cache_fingerprint(self, text: bool = False) -> dict: ...
