"""Training the KL autoencoder (Rombach et al. 2022, arXiv:2112.10752, Sec. 3 and Appendix G):
fine-tune the SD VAE's decoder on a new domain, or train a new latent space.

`AutoencoderKLTraining` is the original `ldm.models.autoencoder.AutoencoderKL` with a training
loss (`lossconfig`: `ldm.vae_loss.LPIPSWithDiscriminator`): an original autoencoder training
config's `model` section builds it unchanged. Its weights keep the original names (`encoder.*`,
`decoder.*`, `quant_conv.*`, `post_quant_conv.*`, `loss.discriminator.*`), so its checkpoints
load as `first_stage_config.params.ckpt_path` and `scripts/swap_vae.py` puts them into a
diffusion checkpoint.

One training step = one batch = one generator (encoder + decoder) update and one discriminator
update on reconstructions made again by the updated generator, as the original's two
optimizers under Lightning 1.x (`training_step` ran once per optimizer). Lightning 2 runs them by manual
optimization; the discriminator's step goes through the strategy (gradient scaling, clipping
hooks, the NaN guard) without counting as a second global step, so `max_steps`, checkpoint
intervals, EMA and `disc_start` count batches as in the original. Under 16-mixed each optimizer
has its own gradient scaler: an overflow of the discriminator does not shrink the generator's
loss scale.
"""

import math
import os
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from ldm.autoencoder import AutoencoderKL, DiagonalGaussianDistribution
from ldm.layout.ema import drop_ema_shadows
from ldm.model_contract import ManualOptimizationContract
from ldm.util import instantiate_from_config

# The 1x1 convs are absent from SD3's VAE (use_quant_conv: false): parts a VAE lacks are skipped.
GENERATOR_PARTS = ("encoder", "decoder", "quant_conv", "post_quant_conv")
FROZEN_BY_DECODER_ONLY = ("encoder", "quant_conv")
LPIPS_PREFIX = "loss.perceptual_loss."  # a fixed metric: never saved, never loaded
DISC_SCALER_KEY = "discriminator_grad_scaler"


class AutoencoderKLTraining(ManualOptimizationContract, AutoencoderKL, pl.LightningModule):
    """The KL autoencoder with its GAN training recipe, as a LightningModule.

    Args:
        ddconfig, embed_dim, ckpt_path, ignore_keys, image_key, use_quant_conv: as `ldm.autoencoder.AutoencoderKL`
            (`ckpt_path` may be an SD checkpoint, a VAE file or an original VAE training
            checkpoint; the VAE's weights are taken, strict).
        lossconfig: `{target: ldm.modules.losses.LPIPSWithDiscriminator (or
            ldm.vae_loss.LPIPSWithDiscriminator), params: {disc_start, kl_weight, disc_weight,
            perceptual_weight, perceptual_weights, disc_loss, rec_loss, ...}}`.
        learning_rate: Adam learning rate of both optimizers (the launcher writes it from
            `base_learning_rate`).
        adam_betas: Adam's betas, (0.5, 0.9) as the original GAN recipe.
        train_decoder_only: freeze the encoder and `quant_conv`, so the latent space - and
            every diffusion model trained on it - stays valid (how sd-vae-ft-mse was made).
        monitor, colorize_nlabels, use_ema: accepted from the original configs (`use_ema` is
            read by the launcher, which adds the EMA callback).
    """

    CKPT_PATH_KEY = "model.params.ckpt_path"  # its name in messages

    def __init__(
        self,
        ddconfig: Mapping,
        lossconfig: Mapping,
        embed_dim: int,
        learning_rate: float = 4.5e-6,
        adam_betas: tuple[float, float] = (0.5, 0.9),
        train_decoder_only: bool = False,
        ckpt_path: str | None = None,
        ignore_keys: tuple[str, ...] = (),
        image_key: str = "image",
        monitor: str | None = None,
        colorize_nlabels: int | None = None,
        use_ema: bool = False,
        use_quant_conv: bool = True,
    ):
        if ckpt_path is not None and not os.path.isfile(ckpt_path):
            raise ValueError(f"model.params.ckpt_path: {ckpt_path} does not exist")
        if colorize_nlabels is not None:
            raise ValueError("colorize_nlabels (segmentation autoencoders) is not supported")
        super().__init__(
            ddconfig,
            embed_dim,
            ckpt_path=ckpt_path,
            ignore_keys=ignore_keys,
            monitor=monitor,
            image_key=image_key,
            use_quant_conv=use_quant_conv,
        )
        self.loss = instantiate_from_config(lossconfig)
        self.image_key, self.learning_rate = image_key, learning_rate
        self.adam_betas = tuple(adam_betas)
        self.train_decoder_only = train_decoder_only
        self.resolution = ddconfig["resolution"]
        # The decoder's last conv in float32: the adaptive weight differentiates the loss there,
        # and in float16 that gradient (a sum over every pixel) overflows (see ldm.vae_loss).
        self.decoder.float32_output = True
        self._last_input: torch.Tensor | None = None  # conv_out's input in the latest forward
        self.decoder.conv_out.register_forward_hook(self._keep_last_input)
        if train_decoder_only:
            for name in self._parts(FROZEN_BY_DECODER_ONLY):
                getattr(self, name).requires_grad_(False)
        self.automatic_optimization = False
        self._grad_scalers: list | None = None
        self._loaded_disc_scaler: dict | None = None
        self._register_state_dict_hook(_drop_lpips_keys)
        self.register_load_state_dict_pre_hook(_keep_own_lpips)

    # --- the contract with lun ----------------------------------------------------------------
    @property
    def ema_module(self) -> nn.Module:
        """The generator (encoder, decoder, the two 1x1 convs): what EMA averages."""
        view = nn.Module()
        for name in self._parts(GENERATOR_PARTS):
            setattr(view, name, getattr(self, name))
        return view

    def _parts(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if hasattr(self, n))

    @property
    def default_image_size(self) -> int:
        return self.resolution

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.downscale
        if height % f or width % f:
            raise ValueError(f"image size {height}x{width}: must be a multiple of {f}")
        return (self.embed_dim, height // f, width // f)

    @torch.no_grad()
    def log_images(self, batch=None, N: int = 4, **kwargs) -> dict[str, torch.Tensor]:
        """Inputs and their reconstructions (posterior mode), (N, 3, H, W) in [-1, 1]."""
        x = batch[self.image_key][:N]
        recs, _ = self(x, sample_posterior=False)
        return {"inputs": x, "reconstructions": recs.clamp(-1, 1)}

    # --- model --------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> DiagonalGaussianDistribution:
        # The posterior in float32: under fp16 autocast exp(0.5 * logvar) and the sampled latent
        # would otherwise be half precision (logvar is clamped at 20: exp(10) ~ 2e4).
        return DiagonalGaussianDistribution(self.moments(x).float())

    def last_layer(self) -> torch.Tensor:
        """The decoder's last weight, where the adaptive GAN weight compares gradients."""
        return self.decoder.conv_out.weight

    def _keep_last_input(self, conv: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._last_input = args[0].detach()

    # --- training -----------------------------------------------------------------------------
    def configure_optimizers(self):
        generator = [p for n in self._parts(GENERATOR_PARTS) for p in getattr(self, n).parameters()]
        generator = [p for p in generator if p.requires_grad]
        opt_g = torch.optim.Adam(generator, lr=self.learning_rate, betas=self.adam_betas)
        opt_d = torch.optim.Adam(
            self.loss.discriminator.parameters(), lr=self.learning_rate, betas=self.adam_betas
        )
        return [opt_g, opt_d]

    def setup(self, stage: str) -> None:
        plugin = self.trainer.precision_plugin
        if stage == "fit" and getattr(plugin, "precision", None) == "16-mixed":
            device = self.trainer.strategy.root_device.type
            # The usual first scale 2**16 suits a per-pixel mean; this loss sums C*H*W pixels
            # (gradients that much larger), so it starts that much lower instead of overflowing
            # for its first ~20 steps. (Lightning gives CPU runs no scaler at all.)
            pixels = self.decoder.conv_out.out_channels * self.resolution**2
            first_scale = 2.0**16 / 2.0 ** math.ceil(math.log2(pixels))
            # The strategy's kind of scaler: FSDP's (sharded gradients) agrees across ranks on
            # skipping an overflowing step.
            scaler = type(plugin.scaler) if plugin.scaler is not None else torch.amp.GradScaler
            self._grad_scalers = [scaler(device, init_scale=first_scale) for _ in range(2)]
            plugin.scaler = self._grad_scalers[0]
            if self._loaded_disc_scaler is not None:
                self._grad_scalers[1].load_state_dict(self._loaded_disc_scaler)

    def training_step(self, batch, batch_idx):
        x = batch[self.image_key]  # (B, 3, H, W) in [-1, 1]
        opt_g, opt_d = self.optimizers()
        step = self.global_step
        recs, posterior = self(x)

        with self._scaler(0):
            # L_G through a surrogate with L_G's gradient: one backward per forward (FSDP).
            surrogate, g_log = self.loss.generator_surrogate(
                x, recs, posterior, step, self.decoder.conv_out, self._last_input
            )
            opt_g.zero_grad(set_to_none=True)
            self.manual_backward(surrogate)
            opt_g.step()  # counts the global step

        if self.loss.gan_factor(step) > 0:
            # The discriminator sees the *updated* generator's reconstructions (a new posterior
            # sample), as the original, whose training_step ran again for optimizer_idx 1 after
            # the generator's step. Before disc_start its loss is 0 and nothing needs them.
            with torch.no_grad():
                recs, _ = self(x)

        with self._scaler(1):
            d_loss, d_log = self.loss.discriminator_loss(x, recs, step)
            opt_d.zero_grad(set_to_none=True)  # also drops what L_G's backward left there
            self.manual_backward(d_loss)
            # Through the strategy (scaling, hooks), not LightningOptimizer: no second step count.
            self.trainer.strategy.optimizer_step(opt_d.optimizer, closure=lambda: None, model=self)

        # Which steps log: `logs_this_step` (ldm.model_contract owns the rule).
        logs = self.logs_this_step()
        if logs:
            parts = {**g_log, **d_log}
            self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=len(x))
        if logs or self.metric_read_this_step("train/loss"):
            self.log("train/loss", g_log["total_loss"], batch_size=len(x))
        return g_log["total_loss"]

    def _scaler(self, index: int):
        """Make `_grad_scalers[index]` the precision plugin's scaler for one optimizer's
        backward and step (nothing to do without fp16 loss scaling)."""
        return _SwapScaler(self, index)

    def validation_step(self, batch, batch_idx):
        x = batch[self.image_key]
        recs, posterior = self(x, sample_posterior=False)
        _, g_log = self.loss.generator_loss(x, recs, posterior, self.global_step)
        _, d_log = self.loss.discriminator_loss(x, recs, self.global_step)
        metrics = {f"val/{k}": v for k, v in {**g_log, **d_log}.items()}
        metrics["val/psnr"] = psnr(x, recs).mean()
        metrics["val/ssim"] = ssim(x, recs).mean()
        if hasattr(self.loss, "perceptual_loss"):
            metrics["val/lpips"] = g_log["p_loss"]
        metrics["val/loss"] = g_log["rec_loss"]  # the launcher's default monitor
        self.log_dict(metrics, batch_size=len(x), sync_dist=True)

    # --- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._grad_scalers is not None:
            checkpoint[DISC_SCALER_KEY] = self._grad_scalers[1].state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Lightning runs `setup` (which makes the scalers) before this hook when resuming.
        state = checkpoint.get(DISC_SCALER_KEY)
        if self._grad_scalers is not None and state is not None:
            self._grad_scalers[1].load_state_dict(state)
        else:
            self._loaded_disc_scaler = state


class _SwapScaler:
    def __init__(self, module: AutoencoderKLTraining, index: int):
        self.module, self.index = module, index

    def __enter__(self) -> None:
        if self.module._grad_scalers is not None:
            self.module.trainer.precision_plugin.scaler = self.module._grad_scalers[self.index]

    def __exit__(self, *exc) -> None:
        if self.module._grad_scalers is not None:
            # Lightning saves and restores the plugin's scaler: keep the generator's there.
            self.module.trainer.precision_plugin.scaler = self.module._grad_scalers[0]


def _drop_lpips_keys(module, state: dict, prefix: str, local_metadata) -> None:
    for key in [k for k in state if k.startswith(prefix + LPIPS_PREFIX)]:
        del state[key]


def _keep_own_lpips(module, state: dict, prefix: str, *args) -> None:
    """LPIPS is loaded from its own files: put this module's weights where a checkpoint has none
    (ours) or other names (original training checkpoints: taming's `net.slice*` / `lin*`).
    The EMA shadows go to the EMA callback (a resumed run with EMA)."""
    drop_ema_shadows(state, prefix)
    for key in [k for k in state if k.startswith(prefix + LPIPS_PREFIX)]:
        del state[key]
    lpips = getattr(module.loss, "perceptual_loss", None)
    if lpips is not None:
        for name, value in lpips.state_dict().items():
            state[prefix + LPIPS_PREFIX + name] = value


# --- validation metrics -------------------------------------------------------------------------
def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per image, images in [-1, 1] (peak 1 after mapping to [0, 1])."""
    mse = ((x.float() - y.float().clamp(-1, 1)) / 2).pow(2).mean(dim=(1, 2, 3))
    return -10.0 * torch.log10(mse.clamp_min(1e-10))


def ssim(x: torch.Tensor, y: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Structural similarity (Wang et al. 2004) per image, Gaussian window 11 / sigma 1.5, on
    images mapped to [0, 1]; averaged over channels and positions."""
    x = (x.float() + 1) / 2
    y = (y.float().clamp(-1, 1) + 1) / 2
    c1, c2 = 0.01**2, 0.03**2
    coords = torch.arange(window, dtype=torch.float32, device=x.device) - (window - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    channels = x.shape[1]
    kernel = (g[:, None] * g[None, :]).expand(channels, 1, window, window).contiguous()

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kernel, groups=channels)  # valid positions only

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    return (num / den).mean(dim=(1, 2, 3))


def autoencoder_kl(lossconfig: Mapping | None = None, **params):
    """The original target `ldm.models.autoencoder.AutoencoderKL`: with a training loss
    (LPIPSWithDiscriminator) the trainable module, with `torch.nn.Identity` / none the frozen
    VAE a diffusion model uses as its first stage."""
    loss_target = None if lossconfig is None else lossconfig.get("target")
    frozen = loss_target in (None, "torch.nn.Identity")
    target = "ldm.autoencoder.AutoencoderKL" if frozen else f"{__name__}.AutoencoderKLTraining"
    # Built through instantiate_from_config: an unknown parameter is named, not a TypeError.
    return instantiate_from_config(
        {"target": target, "params": {**params, "lossconfig": lossconfig}}
    )
