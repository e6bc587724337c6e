"""LatentDiffusion: the Stable Diffusion training module (denoising in a frozen VAE's latent space).

Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"
(arXiv:2112.10752). Submodule and buffer names follow the original CompVis layout so that
`state_dict()` is an original checkpoint and original checkpoints load strictly.
"""

import logging

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from ldm import checkpoint, sampling
from ldm.optim import build_optimizer, build_scheduler
from ldm.schedule import make_betas, rescale_zero_terminal_snr, schedule_buffers, snr
from ldm.util import instantiate_from_config

log = logging.getLogger(__name__)

# Keys of the original configs' `model.params` that describe the original code's bookkeeping.
# They are accepted so that original configs load unchanged, and have no effect here.
ORIGINAL_ONLY_OPTIONS = {
    "num_timesteps_cond",
    "log_every_t",
    "first_stage_key",
    "cond_stage_key",
    "image_size",
    "channels",
    "monitor",
    "use_ema",
    "conditioning_key",
    "cond_stage_forward",
    "scale_by_std",
    "loss_type",
    "ignore_keys",
    "load_only_unet",
}
TIMESTEP_BUCKETS = 4  # loss is also logged per quarter of the timestep range


class DiffusionWrapper(nn.Module):
    """Holds the UNet as `diffusion_model` - the name every original checkpoint uses."""

    def __init__(self, diffusion_model: nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model

    def forward(self, x, t, context=None, y=None):
        return self.diffusion_model(x, t, context=context, y=y)


def _to_original_layout(module, state_dict, prefix, local_metadata):
    checkpoint.to_original_layout(state_dict, prefix, module._clip_has_text_model)


def _from_original_layout(module, state_dict, prefix, *args):
    checkpoint.from_original_layout(state_dict, prefix, module._clip_has_text_model)
    # EMA shadows belong to the EMA callback (or to checkpoint.apply_ema), not to the module.
    for key in [k for k in state_dict if k.startswith(prefix + checkpoint.EMA_PREFIX)]:
        del state_dict[key]


class LatentDiffusion(pl.LightningModule):
    """Text-to-image latent diffusion: frozen VAE + text encoder, trainable UNet.

    Args:
        unet_config, first_stage_config, cond_stage_config: `{target, params}` of the UNet, the
            first stage (VAE, or `IdentityFirstStage` for pixel-space demos) and the text encoder.
        parameterization: what the UNet predicts: "eps" (noise; SD 1.x, 2.x-base) or "v"
            (velocity, Salimans & Ho 2022; SD 2.x-768).
        timesteps, beta_schedule, linear_start, linear_end: the DDPM noise schedule ("linear" is
            SD's: linspace(sqrt(start), sqrt(end)) ** 2).
        zero_terminal_snr: rescale the schedule so the last step is pure noise (Lin et al. 2023,
            arXiv:2305.08891); use with parameterization "v".
        scale_factor: latents are multiplied by it after encoding (0.18215 for the SD VAE).
        ucg_rate: probability of training on the empty caption (for classifier-free guidance).
        min_snr_gamma: weight the loss by min(SNR, gamma)/SNR (Hang et al. 2023,
            arXiv:2303.09556); None = plain MSE. 5.0 is the paper's choice.
        offset_noise: add `offset_noise * N(0, 1)` per sample and channel to the noise, which lets
            the model learn very dark/bright images (Guttenberg 2023); 0.1 is common.
        cond_stage_trainable: train the text encoder too (otherwise frozen, no optimizer state).
        optimizer_config: `{target: adamw | adamw8bit | dotted.Path, params}` (default AdamW,
            weight decay 0.01). scheduler_config: `{target, params}` of an LR multiplier, e.g.
            `ldm.optim.WarmupScheduler` or the original `LambdaLinearScheduler`.
        ckpt_path: weights to start from (original SD `.ckpt`/`.safetensors` or ours);
            load_ema: start from its EMA weights instead of the raw ones.
        first_stage_fp32: run the VAE in its own (float32) weights with autocast off under mixed
            precision; the SD VAE overflows in fp16. Its latents come back in the input's dtype.
        channels_last: keep the UNet's weights and inputs in channels-last memory format (faster
            convolutions on tensor-core GPUs).
        compile_unet: `torch.compile` the UNet in place (names, and so checkpoints, unchanged):
            true, or a dict of `torch.compile` arguments (`{mode: max-autotune}`).
    """

    def __init__(
        self,
        unet_config,
        first_stage_config,
        cond_stage_config,
        parameterization="eps",
        timesteps=1000,
        beta_schedule="linear",
        linear_start=0.00085,
        linear_end=0.012,
        zero_terminal_snr=False,
        scale_factor=0.18215,
        ucg_rate=0.0,
        min_snr_gamma=None,
        offset_noise=0.0,
        cond_stage_trainable=False,
        optimizer_config=None,
        scheduler_config=None,
        ckpt_path=None,
        load_ema=False,
        first_stage_fp32=True,
        channels_last=False,
        compile_unet=None,
        **original_options,
    ):
        super().__init__()
        unknown = set(original_options) - ORIGINAL_ONLY_OPTIONS
        if unknown:
            raise TypeError(
                f"LatentDiffusion got unknown parameter(s): {', '.join(sorted(unknown))}"
            )
        if parameterization not in ("eps", "v"):
            raise ValueError(f"parameterization must be 'eps' or 'v', got '{parameterization}'")
        if original_options.get("conditioning_key", "crossattn") != "crossattn":
            raise ValueError("only conditioning_key: crossattn is supported")
        self.parameterization = parameterization
        self.scale_factor = scale_factor
        self.ucg_rate, self.min_snr_gamma, self.offset_noise = ucg_rate, min_snr_gamma, offset_noise
        self.cond_stage_trainable = cond_stage_trainable
        self.optimizer_config, self.scheduler_config = optimizer_config, scheduler_config
        self.learning_rate = 1.0e-4  # the launcher sets base (or scaled) learning rate
        self.latent_size = original_options.get("image_size", 64)
        self.latent_channels = unet_config["params"]["in_channels"]
        self.downscale = 2 ** (
            len(first_stage_config.get("params", {}).get("ddconfig", {}).get("ch_mult", [1])) - 1
        )
        # Image sides must survive the VAE's and then the UNet's downsampling without remainder.
        self.size_multiple = self.downscale * 2 ** (len(unet_config["params"]["channel_mult"]) - 1)

        self.model = DiffusionWrapper(instantiate_from_config(unet_config))
        self.first_stage_model = instantiate_from_config(first_stage_config)
        self.cond_stage_model = instantiate_from_config(cond_stage_config)
        self.first_stage_model.requires_grad_(False)
        self.cond_stage_model.requires_grad_(cond_stage_trainable)

        betas = make_betas(beta_schedule, timesteps, linear_start, linear_end)
        if zero_terminal_snr:
            betas = rescale_zero_terminal_snr(betas)
        self.num_timesteps = timesteps
        for name, value in schedule_buffers(betas).items():
            self.register_buffer(name, value)

        # Checkpoints are in the original layout whatever the installed transformers names.
        clip = getattr(self.cond_stage_model, "transformer", None)
        self._clip_has_text_model = clip is None or any(
            k.startswith("text_model.") for k in clip.state_dict()
        )
        self.register_state_dict_post_hook(_to_original_layout)
        self.register_load_state_dict_pre_hook(_from_original_layout)
        if ckpt_path:
            checkpoint.load_weights(self, ckpt_path, ema=load_ema)
            log.info("loaded weights from %s%s", ckpt_path, " (EMA)" if load_ema else "")
        self.first_stage_fp32, self.channels_last = first_stage_fp32, channels_last
        if channels_last:
            self.model.diffusion_model.to(memory_format=torch.channels_last)
        if compile_unet:
            self.model.diffusion_model.compile(**({} if compile_unet is True else compile_unet))
        self._loss_window: tuple[list, list] = ([], [])  # per-sample losses, t of this step
        self.train()

    def train(self, mode: bool = True):
        super().train(mode)
        self.first_stage_model.eval()  # frozen parts stay in eval mode (no dropout)
        if not self.cond_stage_trainable:
            self.cond_stage_model.eval()
        return self

    # --- the three models --------------------------------------------------------------------
    @torch.no_grad()
    def encode_first_stage(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> scaled latent (B, C, H/f, W/f), sampled from the posterior."""

        def encode(x):
            return self.first_stage_model.encode(x).sample(generator)

        return self._run_first_stage(encode, images) * self.scale_factor

    @torch.no_grad()
    def decode_first_stage(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latent -> images (B, 3, H, W), roughly in [-1, 1]."""
        return self._run_first_stage(self.first_stage_model.decode, latents / self.scale_factor)

    def _run_first_stage(self, fn, x: torch.Tensor) -> torch.Tensor:
        """`fn(x)` in the VAE's weight dtype with autocast off (`first_stage_fp32`), in x's dtype."""
        weight = next(self.first_stage_model.parameters(), None)
        if not self.first_stage_fp32 or weight is None:
            return fn(x)
        with torch.autocast(x.device.type, enabled=False):
            return fn(x.to(weight.dtype)).to(x.dtype)

    def get_learned_conditioning(self, texts: list[str]) -> torch.Tensor:
        """Captions -> cross-attention context (B, 77, D); no graph unless the encoder trains."""
        with torch.set_grad_enabled(self.cond_stage_trainable and torch.is_grad_enabled()):
            return self.cond_stage_model(list(texts))

    def apply_model(
        self, x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        if self.channels_last:
            x_t = x_t.contiguous(memory_format=torch.channels_last)
        return self.model(x_t, t, context=context)

    # --- training ----------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        loss, per_sample, t = self.diffusion_loss(batch)
        per_sample, t = self._accumulation_window(per_sample, t, batch_idx)
        batch_size = per_sample.shape[0]
        self.log("train/loss", per_sample.mean(), prog_bar=True, batch_size=batch_size)
        bucket = t * TIMESTEP_BUCKETS // self.num_timesteps
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

    def validation_step(self, batch, batch_idx):
        # A generator seeded by the batch index: the same t and noise at every validation.
        generator = torch.Generator(self.device).manual_seed(batch_idx)
        loss, per_sample, _ = self.diffusion_loss(batch, generator)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=per_sample.shape[0])
        return loss

    def diffusion_loss(self, batch, generator: torch.Generator | None = None):
        """Noise the latents at random t, predict eps or v; returns (loss, per-sample loss, t)."""
        if "latent" in batch:
            z = batch["latent"]  # cached latents, already multiplied by scale_factor
        else:
            z = self.encode_first_stage(batch["image"], generator)
        captions = list(batch["caption"])
        if self.training:
            captions = self.drop_captions(captions, generator)
        context = self.get_learned_conditioning(captions)

        b = z.shape[0]
        t = torch.randint(0, self.num_timesteps, (b,), generator=generator, device=z.device)
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        if self.offset_noise:
            noise = noise + self.offset_noise * torch.randn(
                b, z.shape[1], 1, 1, generator=generator, device=z.device, dtype=z.dtype
            )
        a = self.sqrt_alphas_cumprod[t].view(b, 1, 1, 1)
        s = self.sqrt_one_minus_alphas_cumprod[t].view(b, 1, 1, 1)
        x_t = a * z + s * noise
        target = (
            noise if self.parameterization == "eps" else a * noise - s * z
        )  # v = sqrt(abar) eps - sqrt(1-abar) x0

        prediction = self.apply_model(x_t, t, context)
        per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(
            dim=(1, 2, 3)
        )
        if self.min_snr_gamma is not None:
            per_sample = per_sample * self.min_snr_weight(t)
        return per_sample.mean(), per_sample.detach(), t

    def drop_captions(
        self, captions: list[str], generator: torch.Generator | None = None
    ) -> list[str]:
        """Replace each caption by "" with probability `ucg_rate` (Ho & Salimans 2022, CFG training)."""
        if self.ucg_rate <= 0:
            return captions
        drop = torch.rand(len(captions), generator=generator, device=self.device) < self.ucg_rate
        return ["" if d else c for c, d in zip(captions, drop.tolist())]

    def min_snr_weight(self, t: torch.Tensor) -> torch.Tensor:
        """min(SNR, gamma) / SNR for eps, min(SNR, gamma) / (SNR + 1) for v (Hang et al. 2023, Eq. 10)."""
        ratio = snr(self.alphas_cumprod[t]).float()
        clipped = ratio.clamp(max=self.min_snr_gamma)
        if self.parameterization == "v":
            return clipped / (ratio + 1)
        return clipped / ratio.clamp(min=1e-8)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.cond_stage_trainable:
            params += [p for p in self.cond_stage_model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, self.learning_rate, self.optimizer_config)
        scheduler = build_scheduler(optimizer, self.scheduler_config)
        return {"optimizer": optimizer, "lr_scheduler": scheduler} if scheduler else optimizer

    # --- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
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
        """Generate images (B, 3, H, W) in [-1, 1] for `prompts` (img2img when `init_images`)."""
        height = height or self.latent_size * self.downscale
        width = width or self.latent_size * self.downscale
        if height % self.size_multiple or width % self.size_multiple:
            raise ValueError(
                f"height and width must be multiples of {self.size_multiple} for this model, "
                f"got {height}x{width}"
            )
        b = len(prompts)
        context = self.get_learned_conditioning(prompts)
        uncond = None
        if scale != 1.0:
            uncond = self.get_learned_conditioning(negative_prompts or [""] * b)
        shape = (
            b,
            self.latent_channels,
            height // self.downscale,
            width // self.downscale,
        )
        if noise is None:
            noise = torch.randn(shape, generator=generator, device=self.device)
        init_latent = self.encode_first_stage(init_images) if init_images is not None else None
        latents = sampling.sample(
            self.apply_model,
            noise,
            self.alphas_cumprod,
            sampler=sampler,
            steps=steps,
            context=context,
            uncond_context=uncond,
            scale=scale,
            parameterization=self.parameterization,
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
        """Images for the image logger: samples for `prompts` (else the batch captions) with a
        fixed seed, and optionally the batch and its VAE reconstructions. All (N, 3, H, W) in [-1, 1]."""
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
        prompts = list(prompts or batch["caption"])[:N]
        generator = torch.Generator(self.device).manual_seed(seed)
        logs["samples"] = self.sample(
            prompts,
            height=height,
            width=width,
            sampler=sampler,
            steps=steps,
            scale=scale,
            generator=generator,
        )
        return logs
