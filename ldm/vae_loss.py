"""The KL autoencoder's training loss: the recipe of Latent Diffusion (Rombach et al. 2022,
arXiv:2112.10752, Appendix G), itself taming-transformers' VQGAN loss (Esser et al. 2021,
arXiv:2012.09841, Eq. 4-7) with a KL term in place of the codebook:

    L_G = sum(|x - x'| + w_p * LPIPS(x, x')) / B + w_kl * KL(q(z|x) || N(0, I)) / B
          + lambda * disc_factor(step) * (-mean D(x'))
    L_D = disc_factor(step) * hinge(D(x), D(x'))          (or the non-saturating loss)

where the sums run over pixels (the LPIPS distance, one number per image, is added to every
pixel as in the original), disc_factor is 0 before `disc_start`, and lambda is the adaptive
weight ||grad_L nll|| / (||grad_L g|| + 1e-4) * disc_weight at the decoder's last layer L (Esser
et al. Eq. 7). The parameter names are the original `LPIPSWithDiscriminator`'s, so configs load.

Precision: every term, the discriminator's logits and the adaptive weight are computed in
float32 whatever the autocast around them. The pixel sums reach ~1e6 and the KL's exp(logvar)
~5e8, both beyond float16; and the gradient of the pixel sum at the decoder's last weight is a sum
over all H*W positions (~1e5 at 512 px): in float16 it overflows to inf, and lambda = inf / inf
is the NaN the original recipe gave under fp16 (the trainer runs that last layer in float32).
"""

import torch
from torch import nn

from ldm.discriminator import DISC_LOSSES, NLayerDiscriminator
from ldm.lpips import LPIPS, default_vgg16_path

REC_LOSSES = ("l1", "l2")
MAX_ADAPTIVE_WEIGHT = 1e4


def kl_to_standard_normal(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) || N(0, I)) per sample, summed over (C, h, w): shape (B,)."""
    mean, logvar = mean.float(), logvar.float()
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=(1, 2, 3))


class LPIPSWithDiscriminator(nn.Module):
    """Reconstruction + LPIPS + KL + PatchGAN loss of the original KL autoencoder.

    Args:
        disc_start: training step from which the GAN terms count (before it: 0 weight).
        logvar_init: the fixed log-variance dividing the reconstruction term (the original
            declares it learnable but never optimises it; kept as a constant).
        kl_weight: weight of the KL term (1e-6 in the SD autoencoders).
        pixelloss_weight: accepted from the original; it never used it (1.0).
        disc_num_layers, disc_in_channels: PatchGAN depth and input channels.
        disc_factor: weight of the GAN terms once active (1.0).
        disc_weight: multiplier of the adaptive weight (0.5 in the SD autoencoders).
        perceptual_weight: weight of the LPIPS term (1.0; 0 switches LPIPS off).
        use_actnorm, disc_conditional: original options; only false is supported.
        disc_loss: "hinge" or "vanilla" (non-saturating).
        rec_loss: "l1" (original) or "l2" (as the published sd-vae-ft-mse decoder).
        perceptual_weights: torchvision's VGG16 ImageNet file for LPIPS (default: torchvision's
            cached `<torch hub>/checkpoints/vgg16-397923af.pth` when present; "random" gives a
            random backbone, for tests).
        lpips_heads: the LPIPS linear heads file (default: the one in the `lpips` package).
        disc_ndf: width of the discriminator's first layer (64).
    """

    def __init__(
        self,
        disc_start: int,
        logvar_init: float = 0.0,
        kl_weight: float = 1.0,
        pixelloss_weight: float = 1.0,
        disc_num_layers: int = 3,
        disc_in_channels: int = 3,
        disc_factor: float = 1.0,
        disc_weight: float = 1.0,
        perceptual_weight: float = 1.0,
        use_actnorm: bool = False,
        disc_conditional: bool = False,
        disc_loss: str = "hinge",
        rec_loss: str = "l1",
        perceptual_weights: str | None = None,
        lpips_heads: str | None = None,
        disc_ndf: int = 64,
    ):
        super().__init__()
        if disc_loss not in DISC_LOSSES:
            raise ValueError(
                f"lossconfig.params.disc_loss: '{disc_loss}'; expected hinge or vanilla"
            )
        if rec_loss not in REC_LOSSES:
            raise ValueError(f"lossconfig.params.rec_loss: '{rec_loss}'; expected l1 or l2")
        if disc_conditional:
            raise ValueError("lossconfig.params.disc_conditional: only false is supported")
        self.disc_start, self.disc_factor, self.disc_weight = disc_start, disc_factor, disc_weight
        self.kl_weight, self.perceptual_weight = kl_weight, perceptual_weight
        self.rec_loss, self.disc_loss = rec_loss, disc_loss
        self.register_buffer("logvar", torch.tensor(float(logvar_init)))  # original key loss.logvar
        if perceptual_weight > 0:
            perceptual_weights = perceptual_weights or default_vgg16_path()
            if perceptual_weights is None:
                raise ValueError(
                    "lossconfig.params.perceptual_weights: the LPIPS loss needs torchvision's VGG16 "
                    "ImageNet weights (vgg16-397923af.pth, not found in the torch hub cache); "
                    "give its path, or set perceptual_weight: 0"
                )
            self.perceptual_loss = LPIPS(perceptual_weights, lpips_heads)
        self.discriminator = NLayerDiscriminator(
            disc_in_channels, disc_ndf, disc_num_layers, use_actnorm
        )

    def gan_factor(self, step: int) -> float:
        """disc_factor from `disc_start` on, 0 before (the original's `adopt_weight`)."""
        return self.disc_factor if step >= self.disc_start else 0.0

    def reconstruction(self, inputs: torch.Tensor, recs: torch.Tensor):
        """Per-pixel reconstruction term (B, C, H, W) in float32, and the LPIPS distance (B,)."""
        inputs, recs = inputs.float(), recs.float()
        diff = inputs - recs
        rec = diff.abs() if self.rec_loss == "l1" else diff.pow(2)
        if self.perceptual_weight > 0:
            p_loss = self.perceptual_loss(inputs, recs)  # (B, 1, 1, 1)
            rec = rec + self.perceptual_weight * p_loss
            return rec, p_loss.flatten()
        return rec, torch.zeros(len(inputs), device=inputs.device)

    def generator_loss(
        self,
        inputs: torch.Tensor,
        recs: torch.Tensor,
        posterior,
        step: int,
        last_layer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """L_G and its parts. `last_layer` (the decoder's last weight) gives the adaptive weight;
        None (validation) gives 0."""
        with torch.autocast(inputs.device.type, enabled=False):
            rec, p_loss = self.reconstruction(inputs, recs)
            nll = rec / self.logvar.exp() + self.logvar
            nll_loss = nll.sum() / len(nll)
            kl_loss = kl_to_standard_normal(posterior.mean, posterior.logvar).mean()
            factor = self.gan_factor(step)
            if factor > 0:
                logits_fake = self.discriminator(recs.float())
                g_loss = -logits_fake.float().mean()
                d_weight = (
                    self.adaptive_weight(nll_loss, g_loss, last_layer)
                    if last_layer is not None
                    else torch.zeros((), device=inputs.device)
                )
            else:  # skipped before disc_start: 0 * (a finite or not) g_loss
                g_loss = d_weight = torch.zeros((), device=inputs.device)
            loss = nll_loss + self.kl_weight * kl_loss + d_weight * factor * g_loss
        log = self._generator_log(loss, rec, p_loss, nll_loss, kl_loss, g_loss, d_weight, factor)
        return loss, log

    def _generator_log(self, loss, rec, p_loss, nll_loss, kl_loss, g_loss, d_weight, factor):
        """The generator step's figures, named as the original LPIPSWithDiscriminator logs them."""
        return {
            "total_loss": loss.detach(),
            "rec_loss": rec.detach().mean(),
            "p_loss": p_loss.detach().mean(),
            "nll_loss": nll_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "g_loss": g_loss.detach(),
            "d_weight": d_weight.detach(),
            "disc_factor": factor,
            "logvar": self.logvar.detach(),
        }

    def adaptive_weight(self, nll_loss, g_loss, last_layer):
        """lambda = ||grad nll|| / (||grad g|| + 1e-4), clamped to [0, 1e4], times disc_weight
        (Esser et al. 2021, Eq. 7), from the gradients at the decoder's last layer; a
        non-finite ratio (an overflowing step, which the gradient scaler skips) gives 0."""
        nll_grad = torch.autograd.grad(nll_loss, last_layer, retain_graph=True)[0]
        g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
        return self._weight_ratio(nll_grad, g_grad)

    def _weight_ratio(self, nll_grad: torch.Tensor, g_grad: torch.Tensor) -> torch.Tensor:
        weight = nll_grad.float().norm() / (g_grad.float().norm() + 1e-4)
        weight = weight.clamp(0.0, MAX_ADAPTIVE_WEIGHT)
        weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))
        return weight.detach() * self.disc_weight

    def generator_surrogate(
        self,
        inputs: torch.Tensor,
        recs: torch.Tensor,
        posterior,
        step: int,
        last_conv: nn.Conv2d,
        last_input: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """L_G for training, split at the reconstructions: `(surrogate, log)` where the
        surrogate's gradient with respect to the generator is exactly L_G's.

        L_G's terms and their gradients at `recs` are computed on a detached copy; the adaptive
        weight's two gradients at the last layer follow from those by the convolution's weight
        gradient (`last_conv` and its input in the forward, `last_input`), and the generator gets
        <recs, dL_G/drecs> + w_kl * KL. So the discriminator's forward here has one backward and
        the decoder's none before the generator's: what sharded engines (FSDP, whose units
        gather weights for a backward and free them after it) allow, where the original
        differentiated the loss at the last layer through both, three times per step.
        """
        leaf = recs.detach().float().requires_grad_()
        with torch.autocast(inputs.device.type, enabled=False):
            rec, p_loss = self.reconstruction(inputs, leaf)
            nll = rec / self.logvar.exp() + self.logvar
            nll_loss = nll.sum() / len(nll)
            kl_loss = kl_to_standard_normal(posterior.mean, posterior.logvar).mean()
            factor = self.gan_factor(step)
            rec_grad = torch.autograd.grad(nll_loss, leaf)[0]
            if factor > 0:
                g_loss = -self.discriminator(leaf).float().mean()
                g_grad = torch.autograd.grad(g_loss, leaf)[0]
                weights = [
                    conv_weight_grad(last_conv, last_input, grad) for grad in (rec_grad, g_grad)
                ]
                d_weight = self._weight_ratio(*weights)
                rec_grad = rec_grad + d_weight * factor * g_grad
            else:
                g_loss = d_weight = torch.zeros((), device=inputs.device)
            loss = nll_loss + self.kl_weight * kl_loss + d_weight * factor * g_loss
            surrogate = (recs.float() * rec_grad).sum() + self.kl_weight * kl_loss
        log = self._generator_log(loss, rec, p_loss, nll_loss, kl_loss, g_loss, d_weight, factor)
        return surrogate, log

    def discriminator_loss(
        self, inputs: torch.Tensor, recs: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """L_D on real images and detached reconstructions; logits and loss in float32."""
        with torch.autocast(inputs.device.type, enabled=False):
            logits_real = self.discriminator(inputs.detach().float())
            logits_fake = self.discriminator(recs.detach().float())
            d_loss = self.gan_factor(step) * DISC_LOSSES[self.disc_loss](logits_real, logits_fake)
        log = {
            "disc_loss": d_loss.detach(),
            "logits_real": logits_real.detach().mean(),
            "logits_fake": logits_fake.detach().mean(),
        }
        return d_loss, log


def conv_weight_grad(conv: nn.Conv2d, conv_input: torch.Tensor, out_grad: torch.Tensor):
    """The gradient at `conv`'s weight given its input and the gradient at its output (what
    autograd computes for the weight), in float32; the weight's shape from the layer's
    settings, since a sharded layer's `.weight` is only its shard outside its forward."""
    shape = (conv.out_channels, conv.in_channels // conv.groups, *conv.kernel_size)
    return torch.nn.grad.conv2d_weight(
        conv_input.float(), shape, out_grad.float(), conv.stride, conv.padding, conv.dilation,
        conv.groups,
    )  # fmt: skip
