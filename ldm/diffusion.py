"""LatentDiffusion: the Stable Diffusion training module (denoising in a frozen VAE's latent space).

Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"
(arXiv:2112.10752). Submodule and buffer names follow the original CompVis layout so that
`state_dict()` is an original checkpoint and original checkpoints load strictly.
"""

import difflib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields

import lightning.pytorch as pl
import torch
from torch import nn

from ldm import checkpoint, objectives
from ldm.adapters import FitEnd, training_mode
from ldm.attention import preferring, sdpa_kernels
from ldm.compat_api import CompVisAPI, named_conditioning
from ldm.compile_options import compile_arguments
from ldm.conditioning import check_field_widths
from ldm.layout import original
from ldm.model_contract import LatentModelContract
from ldm.optim import build_optimizer, build_scheduler
from ldm.util import ParamError, instantiate_from_config
from ldm.validation import FixedNoiseValidation

log = logging.getLogger(__name__)

TIMESTEP_BUCKETS = 4  # loss is also logged per quarter of the timestep range
SD_SCALE_FACTOR = 0.18215  # the SD VAE's latent scale: the default when no part names one


@dataclass(frozen=True)
class Speed:
    """How the parts run (`model.params.speed`): the VAE's precision, the backbone's memory
    format, compilation and attention kernels - not what the model computes.

    first_stage_fp32: run the VAE in its own (float32) weights with autocast off under mixed
        precision; the SD VAE overflows in fp16. Its latents come back in the input's dtype.
    channels_last: keep the backbone's weights and inputs in channels-last memory format
        (faster convolutions on tensor-core GPUs).
    compile_backbone: `torch.compile` the backbone in place (names, and so checkpoints,
        unchanged): true, or a dict of `torch.compile` arguments (`{mode: max-autotune}`;
        `{mode: reduce-overhead}` adds CUDA graphs: fewer kernel launches). Checked before
        the run: a machine where torch.compile cannot run, or an unknown mode or backend,
        is one error line.
    attention_kernels: the backbone's fused attention kernels, in order of preference (tried in
        that order, then math where none of them takes a call: float32 attention, a head size
        they refuse): `flash`, `cudnn`, `efficient`, `math` (a name or a list); null lets
        PyTorch pick. cudnn and efficient need CUDA (checked before the run). docs/gpu.md says
        which is fastest where.
    """

    first_stage_fp32: bool = True
    channels_last: bool = False
    compile_backbone: bool | Mapping | None = None
    attention_kernels: str | list | None = None


# The flat spellings of the keys `objective:` and `speed:` group, kept as adapters: every config
# written before (and the CompVis / sgm translations in ldm.util) still loads.
FLAT_KEYS = {
    **{name: "objective" for name in objectives.SETTINGS},
    **{f.name: "speed" for f in fields(Speed)},
}


def grouped_settings(flat: Mapping, objective: Mapping | None, speed: Mapping | None):
    """(objective, speed) settings with the flat keys moved into their group; an unknown key
    (or one given both ways) is a ParamError naming it."""
    for name, group in (("objective", objective), ("speed", speed)):
        if group is not None and not isinstance(group, Mapping):
            raise ParamError(f"{name}: expected a mapping of its settings, got {group!r}")
    groups = {"objective": dict(objective or {}), "speed": dict(speed or {})}
    for name, value in flat.items():
        if name not in FLAT_KEYS:
            known = [*inspect.signature(LatentDiffusion).parameters, *FLAT_KEYS]
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ParamError(f"ldm.diffusion.LatentDiffusion: unknown parameter '{name}'{hint}")
        group = groups[FLAT_KEYS[name]]
        if name in group:
            raise ParamError(f"model.params: give {FLAT_KEYS[name]}.{name} or {name}, not both")
        group[name] = value
    unknown = sorted(set(groups["speed"]) - {f.name for f in fields(Speed)})
    if unknown:
        raise ParamError(
            f"model.params.speed: unknown keys {unknown}; expected {[f.name for f in fields(Speed)]}"
        )
    return groups["objective"], Speed(**groups["speed"])


class DiffusionWrapper(nn.Module):
    """Holds the backbone as `diffusion_model` - the name every original checkpoint uses."""

    def __init__(self, diffusion_model: nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]):
        return self.diffusion_model(x, t, cond)


class LatentDiffusion(LatentModelContract, CompVisAPI, pl.LightningModule):
    """Conditional latent diffusion: a frozen first stage (VAE), a conditioner, a trainable backbone.

    The parts meet at three seams: the conditioner turns a batch into named tensors
    (`ldm.conditioning`), the backbone is any module with `forward(x, t, cond)` that tells its
    geometry (`in_channels`, `size_multiple`, `image_size`), and the first stage tells its
    `latent_channels` and `downscale`. Nothing here reads the parts' configs. The original
    configs' names (`unet_config`, `cond_stage_config`, `ucg_rate`, `linear_start`, ...) are
    translated to these by `ldm.util` before construction.

    Args:
        backbone_config: `{target, params}` of the denoising network (`ldm.unet.UNetModel`).
        first_stage_config: the VAE (`ldm.autoencoder.AutoencoderKL`), or `IdentityFirstStage`
            for pixel-space models.
        conditioner_config: the conditioner: a text encoder (`ldm.text_encoder.FrozenCLIPEmbedder`
            (v1), `FrozenOpenCLIPEmbedder` (v2)) or `ldm.conditioning.ClassLabels`; it owns the
            caption / label dropout for classifier-free guidance (its `ucg_rate`).
        parameterization: the objective (`ldm.objectives`), what the backbone predicts: "eps"
            (noise; SD 1.x, 2.x-base), "v" (velocity, Salimans & Ho 2022; SD 2.x-768) or "flow"
            (rectified flow, the velocity e - x_0 of x_t = (1 - t) x_0 + t e; SD3: `ldm.flow`).
        objective: the objective's settings (`ldm.objectives.SETTINGS`; also accepted flat, as
            older configs write them):
            `schedule`: for "flow", how t is drawn and shifted (`ldm.flow.FlowSchedule`:
            timestep_sampling, logit_mean, logit_std, mode_scale, shift). Otherwise the DDPM
            noise schedule, arguments of `ldm.schedule.schedule_betas`: `timesteps` (1000),
            `beta_schedule` ("linear" is SD's: linspace(sqrt(start), sqrt(end)) ** 2),
            `linear_start` (0.00085), `linear_end` (0.012), `cosine_s`, `zero_terminal_snr`
            (Lin et al. 2023, arXiv:2305.08891; use with "v").
            `min_snr_gamma`: weight the loss by min(SNR, gamma)/SNR (eps; /(SNR + 1) for v; Hang
            et al. 2023, arXiv:2303.09556); None = plain MSE. 5.0 is the paper's choice.
            `offset_noise`: add `offset_noise * N(0, 1)` per sample and channel to the noise,
            which lets the model learn very dark/bright images (Guttenberg 2023); 0.1 is common.
        scale_factor: the CompVis spelling of the latent scale; when given it wins over the
            first stage's. Model latents are (z - shift_factor) * scale_factor, with the first
            stage's `shift_factor` (0 for the SD VAEs; SD3's and Flux's VAEs have one) and its
            `scale_factor` when this is None (0.18215, the SD VAE's, when neither says).
        learning_rate: the optimizer's learning rate; the launcher writes `base_learning_rate`
            (scaled with `--scale_lr`) here.
        optimizer_config: `{target: adamw | adamw8bit | dotted.Path, params}` (default AdamW,
            weight decay 0.01). scheduler_config: `{target, params}` of an LR multiplier, e.g.
            `ldm.optim.WarmupScheduler` or the original `LambdaLinearScheduler`.
        ckpt_path: weights to start from (original SD `.ckpt`/`.safetensors` or ours);
            load_ema: start from its EMA weights instead of the raw ones.
        speed: how the parts run, `Speed`: `first_stage_fp32` (default true), `channels_last`,
            `compile_backbone`, `attention_kernels` (also accepted flat, as older configs write
            them).
        schedule_in_checkpoint: keep the DDPM schedule buffers (`betas`, `alphas_cumprod`, ...)
            in the state dict, as CompVis files do; sgm files (SDXL) have none (false).
        lora: train LoRA / LoCon / DoRA adapters on a frozen base instead of the whole backbone:
            `{rank, alpha, dropout, targets: [attn, proj, ff, conv], conv_rank, conv_alpha, dora,
            init, text_encoder: {rank, alpha, dropout, lr}, base_dtype}` (`ldm.lora.LoraSettings`).
        **flat: the old flat spellings of the `objective` and `speed` keys (`FLAT_KEYS`).
    """

    def __init__(
        self,
        backbone_config: Mapping,
        first_stage_config: Mapping,
        conditioner_config: Mapping,
        parameterization: str = "eps",
        objective: Mapping | None = None,
        scale_factor: float | None = None,
        learning_rate: float = 1.0e-4,
        optimizer_config: Mapping | None = None,
        scheduler_config: Mapping | None = None,
        ckpt_path: str | None = None,
        load_ema: bool = False,
        speed: Mapping | None = None,
        lora: Mapping | None = None,
        schedule_in_checkpoint: bool = True,
        **flat,
    ):
        super().__init__()
        # Everything that can be wrong in the settings is checked before anything is built.
        objective, speed = grouped_settings(flat, objective, speed)
        objective = objectives.build(parameterization, objective)
        self.training_mode = training_mode(lora)  # full fine-tuning, or adapters (`lora:`)
        compile_options = (
            compile_arguments(speed.compile_backbone) if speed.compile_backbone else None
        )
        kernels = speed.attention_kernels
        self.sdpa_kernels = None if kernels is None else sdpa_kernels(kernels)
        self.learning_rate = learning_rate
        self.optimizer_config, self.scheduler_config = optimizer_config, scheduler_config

        # Submodule names are the original checkpoints' (see ldm.checkpoint).
        self.model = DiffusionWrapper(instantiate_from_config(backbone_config))
        self.first_stage_model = instantiate_from_config(first_stage_config)
        conditioner = instantiate_from_config(conditioner_config)
        # The conditioner's checkpoint name is its own (see ldm.layout.original.conditioner_name).
        self._conditioner_name = original.conditioner_name(conditioner)
        # (Set directly: add_module refuses "conditioner", the name of the property below.)
        self._modules[self._conditioner_name] = conditioner
        self.first_stage_model.requires_grad_(False)
        self._check_geometry(scale_factor)
        check_field_widths(conditioner, self.backbone)  # one line now, not a shape error at step 1
        # A backbone that also outputs its variance (DiT's learn_sigma) has its own objective.
        self.objective = objectives.for_backbone(objective, self.backbone)
        self.register_load_state_dict_pre_hook(checkpoint.load_state_dict_pre_hook)

        # The DDPM schedule buffers keep the CompVis names (a flow model keeps the default ones).
        self.num_timesteps = self.objective.num_timesteps
        self.validation_loss = FixedNoiseValidation(self.num_timesteps, TIMESTEP_BUCKETS)
        buffers = self.objective.schedule_buffers()
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=schedule_in_checkpoint)
        self._schedule_names = tuple(buffers)

        self.training_mode.attach(self)  # before loading: a LoRA run's file has its adapters
        if ckpt_path:
            loaded = checkpoint.load_weights(self, ckpt_path, ema=load_ema)
            self.training_mode.after_loading(self, loaded)
            log.info("loaded weights from %s%s", ckpt_path, " (EMA)" if load_ema else "")
        self.first_stage_fp32, self.channels_last = speed.first_stage_fp32, speed.channels_last
        if speed.channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        if speed.compile_backbone:
            self.backbone.compile(**compile_options)
        self._loss_window: tuple[list, list] = ([], [])  # per-sample losses, t of this step
        self.train()

    def _check_geometry(self, scale_factor: float | None) -> None:
        """Latent channels, downscale, size multiple and the latents' shift and scale, from the
        built parts (`scale_factor`, the CompVis argument, wins over the first stage's)."""
        backbone, first_stage = self.backbone, self.first_stage_model
        if backbone.in_channels != first_stage.latent_channels:
            raise ValueError(
                f"the backbone takes {backbone.in_channels} channels, the first stage makes "
                f"{first_stage.latent_channels} (backbone_config.params.in_channels)"
            )
        self.latent_channels = first_stage.latent_channels
        self.downscale = first_stage.downscale
        # Image sides must survive the first stage's and then the backbone's downsampling.
        self.size_multiple = self.downscale * backbone.size_multiple
        self.latent_size = backbone.image_size or 64  # default sample size, in latent pixels
        if scale_factor is None:
            scale_factor = first_stage.scale_factor
        self.scale_factor = SD_SCALE_FACTOR if scale_factor is None else float(scale_factor)
        self.shift_factor = float(first_stage.shift_factor)

    @property
    def backbone(self) -> nn.Module:
        return self.model.diffusion_model

    @property
    def conditioner(self) -> nn.Module:
        """The conditioner, under its checkpoint name (`cond_stage_model` for SD 1.x/2.x)."""
        return self._modules[self._conditioner_name]

    # --- the contract with lun (lun.contract.TrainableModule) ---------------------------------
    @property
    def ema_module(self) -> nn.Module:
        """The module whose trainable weights an EMA averages (checkpoint names `model.*`)."""
        return self.model

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) of the latent of an image of height x width pixels."""
        if height % self.size_multiple or width % self.size_multiple:
            raise ValueError(
                f"height and width must be multiples of {self.size_multiple} for this model, "
                f"got {height}x{width}"
            )
        # A backbone with a fixed position table (MMDiT) takes latents up to a side.
        largest = getattr(self.backbone, "max_latent_side", None)
        if largest is not None and max(height, width) > largest * self.downscale:
            raise ValueError(
                f"height and width must be at most {largest * self.downscale} for this model "
                f"(its position table), got {height}x{width}"
            )
        return self.latent_channels, height // self.downscale, width // self.downscale

    @property
    def default_image_size(self) -> int:
        """Image side the model was made for (the backbone's native latent size x downscale)."""
        return self.latent_size * self.downscale

    def train(self, mode: bool = True):
        super().train(mode)
        self.first_stage_model.eval()  # frozen: no dropout (a frozen conditioner sees to itself)
        return self

    @property
    def parameterization(self) -> str:
        """The objective's config name: "eps", "v" or "flow"."""
        return self.objective.name

    @property
    def schedule(self) -> dict[str, torch.Tensor]:
        """The schedule buffers (CompVis names) the objective reads, on the module's device."""
        return {name: getattr(self, name) for name in self._schedule_names}

    # --- the three models --------------------------------------------------------------------
    def scale_latents(self, z: torch.Tensor) -> torch.Tensor:
        """First-stage latents -> the backbone's: (z - shift_factor) * scale_factor."""
        return (z - self.shift_factor) * self.scale_factor

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The backbone's latents -> the first stage's: latents / scale_factor + shift_factor."""
        return latents / self.scale_factor + self.shift_factor

    @torch.no_grad()
    def encode_first_stage(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> scaled latent (B, C, H/f, W/f), sampled from the posterior."""

        def encode(x):
            return self.first_stage_model.encode(x).sample(generator)

        return self.scale_latents(self._run_first_stage(encode, images))

    def cached_latent(
        self, latent: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """A cached first-stage output -> scaled latent: posterior moments (B, 2C, h, w) are
        sampled as `encode_first_stage` samples them (same draw, same stream); a latent already
        sampled and scaled (B, C, h, w) is used as it is (`batch_latents`, the contract's rule)."""
        return self.batch_latents({"latent": latent}, generator)

    @torch.no_grad()
    def decode_first_stage(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latent -> images (B, 3, H, W), roughly in [-1, 1]."""
        return self._run_first_stage(self.first_stage_model.decode, self.unscale_latents(latents))

    def _run_first_stage(self, fn, x: torch.Tensor) -> torch.Tensor:
        """`fn(x)` in the VAE's weight dtype with autocast off (`first_stage_fp32`), in x's dtype."""
        weight = next(self.first_stage_model.parameters(), None)
        if not self.first_stage_fp32 or weight is None:
            return fn(x)
        with torch.autocast(x.device.type, enabled=False):
            return fn(x.to(weight.dtype)).to(x.dtype)

    def conditioning(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]:
        """The conditioner's named tensors for `batch` (with CFG dropout when `drop`)."""
        cond = self.conditioner.condition(batch, generator, drop)
        return {field: value.to(self.device) for field, value in cond.items()}

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]:
        """The guidance's unconditional side for `batch` (null inputs, or `negative`)."""
        cond = self.conditioner.unconditional(batch, negative)
        return {field: value.to(self.device) for field, value in cond.items()}

    def apply_model(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The backbone's output for `cond`, our dict or an original form (a bare context
        tensor, CompVis' `c_crossattn` dict: `ldm.compat_api`)."""
        cond = named_conditioning(cond)
        if self.channels_last:
            x_t = x_t.contiguous(memory_format=torch.channels_last)
        if self.sdpa_kernels is None:
            return self.model(x_t, t, cond)
        with preferring(self.sdpa_kernels):
            return self.model(x_t, t, cond)

    def predict(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """What the objective compares with its target (eps, v or the flow's velocity): the
        backbone's output without a learn_sigma backbone's variance half."""
        return self.objective.prediction(self.apply_model(x_t, t, cond))

    # --- training ----------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        loss, per_sample, t = self.diffusion_loss(batch)
        per_sample, t = self._accumulation_window(per_sample, t, batch_idx)
        batch_size = per_sample.shape[0]
        # Which steps log: `logs_this_step` (ldm.model_contract owns the rule).
        logs = self.logs_this_step()
        if logs or self.metric_read_this_step("train/loss"):
            self.log("train/loss", per_sample.mean(), batch_size=batch_size)
        if not logs:
            return loss  # the per-t losses need host reads: only on the steps that log
        bucket = (t * TIMESTEP_BUCKETS // self.num_timesteps).long()  # t is float for flow
        for b in bucket.unique().tolist():
            lo, hi = (
                b * self.num_timesteps // TIMESTEP_BUCKETS,
                (b + 1) * self.num_timesteps // TIMESTEP_BUCKETS - 1,
            )
            self.log(
                f"train/loss_t{lo}-{hi}",
                per_sample[bucket == b].mean(),
                on_step=True,
                on_epoch=False,
                batch_size=int((bucket == b).sum()),
            )
        return loss

    def _accumulation_window(self, per_sample: torch.Tensor, t: torch.Tensor, batch_idx: int):
        """Per-sample losses and t of all micro-batches of this optimizer step so far.

        With gradient accumulation Lightning logs once per optimizer step, the value logged by
        its last micro-batch: logging the whole window makes that the loss of every sample the
        step's gradient came from (as without accumulation), not of the last micro-batch only.
        """
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        if accumulate == 1:
            return per_sample, t
        if batch_idx % accumulate == 0:
            self._loss_window = ([], [])
        self._loss_window[0].append(per_sample)
        self._loss_window[1].append(t)
        return torch.cat(self._loss_window[0]), torch.cat(self._loss_window[1])

    # --- validation: fixed t and noise per item (ldm.validation) ----------------------------
    def on_validation_epoch_start(self) -> None:
        self.validation_loss.reset()

    def validation_step(self, batch, batch_idx):
        """The batch's loss at each item's fixed timesteps and noise (`ldm.validation`); the
        figures are logged once all ranks are done, in `on_validation_epoch_end`."""
        return self.validation_loss.step(self, batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        """Logs `val/loss`, its timestep buckets `val/loss_t<lo>-<hi>`, the number of items
        `val/items`, and under the original
        models' names `val/loss_simple` and `val/loss_simple_ema`, so a `monitor:` written for
        either finds its key. The weights are those the trainer validates: the EMA weights when
        an EMA callback swaps them in (`validate_with_ema`, its default), the raw weights
        otherwise - the same value under all three names (ldm cannot see the callback)."""
        figures = self.validation_loss.finish(self)
        if "val/loss" in figures:
            figures["val/loss_simple"] = figures["val/loss_simple_ema"] = figures["val/loss"]
            figures["val/items"] = self.validation_loss.items  # each counted once
        for key, value in figures.items():
            # Already reduced over all ranks: "max" of equal values keeps them bit for bit.
            self.log(key, value, prog_bar=key == "val/loss", sync_dist=True, reduce_fx="max")

    def diffusion_loss(self, batch, generator: torch.Generator | None = None):
        """Noise the latents at times t drawn by the objective; returns (loss, per-sample loss,
        t in the backbone's units)."""
        z = self.batch_latents(batch, generator)  # cached latents or images (TrainingBatch)
        cond = self.conditioning(batch, generator, drop=self.training)
        t = self.objective.sample_t(z.shape[0], generator, z.device, latent_size=z.shape[-2:])
        noise = self.objective.draw_noise(z, generator)
        per_sample = self.loss_at(z, cond, t, noise, batch)
        return per_sample.mean(), per_sample.detach(), t

    def loss_at(self, z, cond, t, noise, batch) -> torch.Tensor:
        """Per-sample loss (B,) of the latents z noised with `noise` at times t (the objective's,
        `ldm.objectives`), times the batch's per-image weights (DreamBooth's prior loss)."""
        per_sample = self.objective.loss(self.apply_model, z, noise, t, cond, self.schedule)
        return per_sample * self.batch_loss_weights(batch, per_sample)

    def configure_optimizers(self):
        params = self.training_mode.parameter_groups(
            [p for p in self.model.parameters() if p.requires_grad],
            [p for p in self.conditioner.parameters() if p.requires_grad],
        )
        optimizer = build_optimizer(
            params, self.learning_rate, self.optimizer_config, fuse=not self._clips_under_amp()
        )
        scheduler = build_scheduler(optimizer, self.scheduler_config)
        return {"optimizer": optimizer, "lr_scheduler": scheduler} if scheduler else optimizer

    # --- the training mode's hooks (`ldm.adapters`: full fine-tuning, or LoRA's frozen base
    # in the training dtype and checkpoints in the original layout) ---------------------------
    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.training_mode.on_fit_start(self, self.trainer, self.strategy_casts_parameters)

    def teardown(self, stage: str) -> None:
        if stage == "fit":  # a normal end; an exception's comes through `FitEnd`
            self.training_mode.on_fit_end(self)

    def configure_callbacks(self):
        return [FitEnd()]

    def on_save_checkpoint(self, ckpt: dict) -> None:
        self.training_mode.on_save_checkpoint(self, ckpt)

    def on_load_checkpoint(self, ckpt: dict) -> None:
        self.training_mode.on_load_checkpoint(self, ckpt)

    @property
    def lora_settings(self):
        """The training mode's settings: a LoRA run's `ldm.lora.LoraSettings` (None when the
        whole backbone trains); lun's memory plan resolves `base_quantization: auto` into it."""
        return self.training_mode.settings

    @lora_settings.setter
    def lora_settings(self, settings) -> None:
        self.training_mode.settings = settings

    def _clips_under_amp(self) -> bool:
        """Lightning's mixed-precision plugin clips gradients itself and refuses an optimizer
        that unscales them internally (a fused one): with clipping, AdamW is not fused."""
        from lightning.pytorch.plugins.precision import MixedPrecision

        trainer = self._trainer
        return (
            trainer is not None
            and bool(trainer.gradient_clip_val)
            and isinstance(trainer.precision_plugin, MixedPrecision)
        )

    # --- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        inputs,
        negative=None,
        *,
        height: int | None = None,
        width: int | None = None,
        sampler: str = "ddim",
        steps: int = 50,
        scale: float = 7.5,
        eta: float = 0.0,
        karras: bool = False,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        init_images: torch.Tensor | None = None,
        strength: float = 1.0,
    ) -> torch.Tensor:
        """Generate images (B, 3, H, W) in [-1, 1] (img2img when `init_images`).

        inputs: what the conditioner reads - prompts (list of str), class ids, or a batch dict;
        negative: the unconditional side's inputs instead of the null ones (negative prompts).
        """
        height = height or self.default_image_size
        width = width or self.default_image_size
        # The size of the images made, for size-conditioned models (SDXL); others ignore it.
        batch = {"image_size": (height, width), **self.conditioner.batch_of(inputs)}
        cond = self.conditioning(batch)
        uncond = self.unconditional(batch, negative) if scale != 1.0 else None
        shape = (next(iter(cond.values())).shape[0], *self.latent_shape(height, width))
        if noise is None:
            noise = torch.randn(shape, generator=generator, device=self.device)
        init_latent = self.encode_first_stage(init_images) if init_images is not None else None
        latents = self.objective.sample(
            self.apply_model,
            noise,
            self.schedule,
            sampler=sampler,
            steps=steps,
            cond=cond,
            uncond=uncond,
            scale=scale,
            eta=eta,
            karras=karras,
            generator=generator,
            init_latent=init_latent,
            strength=strength,
        )
        return self.decode_first_stage(latents).clamp(-1, 1)

    @torch.no_grad()
    def log_images(
        self,
        batch=None,
        N: int = 4,
        prompts: list[str] | None = None,
        seed: int = 0,
        sampler: str = "ddim",
        steps: int = 20,
        scale: float = 5.0,
        reconstructions: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Images for the image logger: samples for `prompts` (else the batch's conditioning inputs:
        captions, labels) with a fixed seed, and optionally the batch and its VAE reconstructions.
        All (N, 3, H, W) in [-1, 1]."""
        logs = {}
        height = width = None
        if batch is not None and "image" in batch:
            images = batch["image"][:N]
            height, width = images.shape[-2:]
            logs["inputs"] = images
            if reconstructions:
                logs["reconstructions"] = self.decode_first_stage(
                    self.encode_first_stage(images)
                ).clamp(-1, 1)
        inputs = prompts if prompts else batch[self.conditioner.input_key]
        generator = torch.Generator(self.device).manual_seed(seed)
        logs["samples"] = self.sample(
            inputs[:N],
            height=height,
            width=width,
            sampler=sampler,
            steps=steps,
            scale=scale,
            generator=generator,
        )
        return logs
