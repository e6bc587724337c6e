"""The methods a model implements for `lun` (the protocols of `lun/contract.py`), as mixins.

lun (the launcher, the data cache, the generation scripts, the memory plan) asks a module these
questions and reads nothing else of it, so a new family or mode answers them here, in its own
terms, instead of lun growing `if`s about its parts:

- `TrainingContract` (every trained module): gradient checkpointing on/off, whether the module
  steps its own optimizers, which strategies it cannot run under;
- `LatentModelContract` (latent diffusion): images -> model latents, captions -> conditioning,
  the fingerprint a latent cache is keyed by, the class count of a class-conditional model;
- `TrainingBatch`: the keys the data hands a latent diffusion step, read only through
  `batch_latents` and `batch_loss_weights` (no step asks which dataset or mode wrote them).

Model latents are `(z - shift_factor) * scale_factor` of a first-stage sample z (the VAE's
`scaling_factor` / `shift_factor` in diffusers' config; SD 1.x/2.x: 0.18215 and 0; SD3: 1.5305
and 0.0609).
"""

import hashlib
import json
from collections.abc import Mapping
from typing import TypedDict

import torch
from torch import nn

# Attributes of a module that do not change what it computes for a cached input.
NOT_IN_FINGERPRINT = {"training", "trainable", "ucg_rate"}


def module_fingerprint(module: nn.Module) -> str:
    """Hash of a module's class, plain settings (max_length, layer, ...) and every tensor of its
    state dict (names, dtypes, shapes, bytes): equal exactly when it computes the same function."""
    digest = hashlib.blake2b(digest_size=16)
    kind = type(module)
    settings = {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and name not in NOT_IN_FINGERPRINT
        and isinstance(value, str | int | float | bool | type(None))
    }
    digest.update(
        json.dumps([kind.__module__, kind.__qualname__, settings], sort_keys=True).encode()
    )
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TrainingBatch(TypedDict, total=False):
    """A batch of a latent diffusion model's training or validation step, as `lun.data` writes it.

    image: (B, 3, H, W) in [-1, 1], encoded by the first stage in the step; absent when `latent`
        is given.
    latent: cached first-stage output (`scripts/cache_latents.py`, `lun.data.latent_cache`): the
        posterior moments (B, 2C, h, w), mean and log-variance in the VAE's units, sampled in
        the step as an image's would be; or (B, C, h, w), a latent already sampled and scaled.
    loss_weight: (B,) weight of each sample's loss (DreamBooth's prior preservation,
        `lun.data.dreambooth`); absent: 1.
    caption, label, ...: what the conditioner reads (its `input_key`; SDXL's size and crop
        keys), and `context`: cached conditioning (`ldm.conditioning`).
    """

    image: torch.Tensor
    latent: torch.Tensor
    loss_weight: torch.Tensor
    caption: list[str]


class TrainingContract:
    """How a LightningModule trains, as lun asks it (lun.contract.TrainableModule).

    Defaults fit a module Lightning optimizes (one optimizer step per batch) with no gradient
    checkpointing; a module overrides what differs."""

    # Set by lun before fit (`lun.strategies.casts_parameters`; ldm cannot import lun): whether
    # the strategy holds the parameters in its own form and dtype (FSDP, DeepSpeed).
    strategy_casts_parameters: bool = False

    @property
    def steps_own_optimizers(self) -> bool:
        """True when `training_step` steps the optimizers itself (Lightning's manual
        optimization: the VAE's generator and discriminator). Such a step cannot be run
        without a trainer, and its backward passes are not one per batch."""
        return not self.automatic_optimization

    @property
    def gradient_checkpointing(self) -> bool | None:
        """Whether the trained network recomputes activations in backward; None: it cannot."""
        return None

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        if enabled:
            raise ValueError(f"{type(self).__name__} has no gradient checkpointing")

    def strategy_problem(
        self, strategy: str, find_unused_parameters: bool = False, resuming: bool = False
    ) -> str | None:
        """Why this module cannot train under `strategy` ("ddp", "deepspeed", "fsdp",
        "model_parallel", "single"), as one line naming the key to change; None when it can."""
        return None

    # --- which training steps log -------------------------------------------------------------
    # A value given to Lightning's `self.log` becomes a number on the host (a host-device sync
    # on an accelerator) when the logger writes it or the progress bar shows it, and each call
    # costs ~1.5 % of a tiny step even when nothing reads it. So a training step logs on the
    # steps the logger writes (`log_every_n_steps`) and logs its loss otherwise only where it is
    # read: the last step (what `trainer.callback_metrics` holds after the fit) and, when a
    # callback or LR scheduler monitors it, every step. Nothing goes to the progress bar: ours
    # shows the smoothed loss `training_step` returns.
    _monitored_metrics: frozenset = frozenset()  # found once per fit (on_train_start)

    def logs_this_step(self) -> bool:
        """Whether the logger writes at this training step (always, without a trainer)."""
        return self._trainer is None or self.trainer._logger_connector.should_update_logs

    def metric_read_this_step(self, key: str) -> bool:
        """Whether `key` must be logged at a step the logger does not write."""
        if key in self._monitored_metrics:
            return True
        trainer = self.trainer
        if trainer.max_steps > 0 and self.steps_after_this_batch() >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        return 0 < max_epochs <= trainer.current_epoch + 1 and trainer.is_last_batch

    def steps_after_this_batch(self) -> int:
        """Optimizer steps done once this batch's step is (Lightning counts it after
        `training_step` returns)."""
        return self.trainer.global_step + 1

    def on_train_start(self) -> None:
        # What callbacks and LR schedulers monitor is fixed for the fit: found once here, not
        # at every step that writes no logs.
        monitors = [getattr(callback, "monitor", None) for callback in self.trainer.callbacks]
        monitors += [config.monitor for config in self.trainer.lr_scheduler_configs]
        self._monitored_metrics = frozenset(m for m in monitors if m)


class ManualOptimizationContract(TrainingContract):
    """A module that steps two optimizers per batch itself (the VAE's generator and
    discriminator, `ldm.autoencoder_training`)."""

    def steps_after_this_batch(self) -> int:
        # Its `training_step` steps the optimizers (and so counts the step) before it logs.
        return self.trainer.global_step

    def strategy_problem(
        self, strategy: str, find_unused_parameters: bool = False, resuming: bool = False
    ) -> str | None:
        """DeepSpeed: Lightning hands it one optimizer. DDP: each backward leaves the other
        optimizer's weights without gradients, which DDP accepts only with
        `find_unused_parameters: true`. FSDP trains it (lun.strategies.FSDPStrategy makes each
        trainable part its own root), but the optimizer states Lightning gathers into its
        checkpoints then do not match the weights (seen: the Adam moments of a 2-process CPU run
        match none of DDP's, and a resumed step moved a weight 20x further than a straight
        one): a resume is refused."""
        name = type(self).__name__
        if resuming and strategy == "fsdp":
            return (
                f"--resume: {name} cannot resume under FSDP (its checkpoints' optimizer states "
                "are not valid); start a new run from the weights: model.params.ckpt_path="
                "<checkpoint>"
            )
        if strategy == "deepspeed":
            return (
                f"lightning.strategy: {name} steps two optimizers (manual optimization), which "
                "Lightning's DeepSpeed strategy cannot run; use strategy: ddp or fsdp"
            )
        if strategy == "ddp" and not find_unused_parameters:
            return (
                "lightning.strategy.params.find_unused_parameters: must be true for "
                f"{name}: its generator and discriminator backward passes each leave the "
                "other's weights without gradients"
            )
        return None


class LatentModelContract(TrainingContract):
    """What lun asks a latent diffusion model, for a module with `first_stage_model`,
    `conditioner`, `backbone`, `scale_factor`, `shift_factor` and `scale_latents`."""

    # --- latents ------------------------------------------------------------------------------
    @torch.no_grad()
    def first_stage_moments(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> the first stage's posterior moments (B, 2C, h, w): mean and
        log-variance in the VAE's own units, float32, computed in the VAE's weight dtype with
        autocast off (what a latent cache stores)."""
        vae = self.first_stage_model
        weight = next(vae.parameters())
        with torch.autocast(images.device.type, enabled=False):
            posterior = vae.encode(images.to(weight.device, weight.dtype))
        return torch.cat([posterior.mean, posterior.logvar], dim=1).float()

    def to_model_latents(self, z: torch.Tensor) -> torch.Tensor:
        """A first-stage latent z -> what the backbone sees: (z - shift_factor) * scale_factor
        (the module's `scale_latents`, the one owner of the rule)."""
        return self.scale_latents(z)

    @torch.no_grad()
    def encode_latents(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> model latents, one posterior sample drawn from `generator`."""
        return self.encode_first_stage(images, generator)

    def batch_latents(
        self, batch: Mapping, generator: torch.Generator | None = None, mean: bool = False
    ) -> torch.Tensor:
        """Model latents of a `TrainingBatch`: its cached `latent` (no VAE pass) or its `image`
        encoded; one posterior sample drawn from `generator` (the same draw, on the same stream,
        for both), or with `mean` the posterior's mean (validation's noise-free latent). A latent
        cached already sampled and scaled is used as it is."""
        from ldm.autoencoder import DiagonalGaussianDistribution

        latent = batch.get("latent")
        if latent is None:
            if not mean:
                return self.encode_first_stage(batch["image"], generator)
            encode = self.first_stage_model.encode
            return self.scale_latents(
                self._run_first_stage(lambda x: encode(x).mode(), batch["image"])
            )
        if latent.shape[1] != 2 * self.latent_channels:
            return latent
        posterior = DiagonalGaussianDistribution(latent)
        return self.scale_latents(posterior.mode() if mean else posterior.sample(generator))

    @staticmethod
    def batch_loss_weights(batch: Mapping, per_sample: torch.Tensor) -> torch.Tensor:
        """The weights of a `TrainingBatch`'s per-sample losses, in their dtype and device: its
        `loss_weight`, else 1 (a 0-dim one: the product is exact)."""
        weights = batch.get("loss_weight")
        return per_sample.new_ones(()) if weights is None else weights.to(per_sample)

    def encoders_to(self, device: torch.device | str) -> None:
        """The first stage (in eval mode) and the conditioner to `device`: what encoding
        latents and captions runs, without the backbone."""
        self.first_stage_model.to(device).eval()
        self.conditioner.to(device)

    def load_first_stage(self, path: str, what: str = "--vae") -> None:
        """Replace the first stage's weights with the VAE in `path` (strict: same names and
        shapes; `what` names the option in the error line)."""
        from ldm import checkpoint

        checkpoint.load_first_stage(self.first_stage_model, path, what=what)

    # --- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_captions(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The conditioning fields (`crossattn`, `vector`, ...) of captions, none dropped."""
        return self.conditioner.condition({"caption": list(captions)}, drop=False)

    @property
    def caption_conditioning_frozen(self) -> bool:
        """True when the conditioning of a caption never changes in training (a frozen text
        encoder reading captions): only then can it be cached."""
        conditioner = self.conditioner
        return not getattr(conditioner, "trainable", True) and conditioner.input_key == "caption"

    @property
    def class_count(self) -> int | None:
        """The number of classes of a class-conditional model; None for a text model."""
        conditioner = self.conditioner
        return conditioner.num_classes if conditioner.input_key == "label" else None

    # --- sampling -----------------------------------------------------------------------------
    @property
    def guidance_distilled(self) -> bool:
        """True for a model distilled not to need classifier-free guidance (Flux dev and
        schnell: their conditioner has a `guidance` setting), sampled at scale 1 by default."""
        return hasattr(self.conditioner, "guidance")

    @property
    def embedded_guidance(self) -> float | None:
        """The guidance value a guidance-distilled model takes as an input (Flux dev's), fed in
        training and sampling; None for a model that takes none."""
        return getattr(self.conditioner, "guidance", None)

    @embedded_guidance.setter
    def embedded_guidance(self, value: float) -> None:
        if self.embedded_guidance is None:
            raise ValueError("this model takes no distilled guidance value (Flux dev does)")
        self.conditioner.guidance = float(value)

    @property
    def max_latent_side(self) -> int | None:
        """The largest latent side the backbone takes (MMDiT's position table), None: any."""
        return getattr(self.backbone, "max_latent_side", None)

    # --- the latent cache ---------------------------------------------------------------------
    def cache_fingerprint(self, text: bool = False) -> dict:
        """What cached latents depend on: the first stage's weights and the latent scale and
        shift; with `text`, also the text encoder's weights (None without)."""
        found = {
            "first_stage": module_fingerprint(self.first_stage_model),
            "scale_factor": float(self.scale_factor),
            "text": module_fingerprint(self.conditioner) if text else None,
        }
        shift = float(self.shift_factor)
        if shift:  # caches made before the shift existed stay valid (their shift is 0)
            found["shift_factor"] = shift
        return found

    # --- training -----------------------------------------------------------------------------
    @property
    def gradient_checkpointing(self) -> bool | None:
        return getattr(self.backbone, "use_checkpoint", None)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        if not hasattr(self.backbone, "set_gradient_checkpointing"):
            super().set_gradient_checkpointing(enabled)
            return
        self.backbone.set_gradient_checkpointing(enabled)

    # --- conversion and comparison with other tools -------------------------------------------
    # The converters write each part in another tool's layout, and a benchmark times one part
    # against that tool's: they are about the parts. Training (lun) never needs these.
    @property
    def latent_scaling(self) -> tuple[float, float]:
        """(scale, shift) of the first stage's latents, as diffusers' VAE config holds them
        (`scaling_factor`, `shift_factor`): what a converter writes there. The model applies
        them in `to_model_latents`."""
        return float(self.scale_factor), float(self.shift_factor)

    @property
    def denoiser(self) -> nn.Module:
        """The denoising network alone (UNet, DiT, MMDiT): what scripts/convert_sd3.py writes as
        diffusers' transformer (its config read from it) and scripts/benchmark_lora.py times
        against diffusers' UNet."""
        return self.backbone

    @property
    def caption_conditioner(self) -> nn.Module:
        """The module that turns captions into conditioning, with its text encoders and their
        tokenizers: what the converters write as diffusers' `text_encoder*` / `tokenizer*`
        folders (scripts/convert.py, scripts/convert_sd3.py)."""
        return self.conditioner
