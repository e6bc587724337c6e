"""The PatchGAN discriminator of taming-transformers (Esser et al. 2021, arXiv:2012.09841, Sec. 3.1),
after pix2pix (Isola et al. 2017): a stack of 4x4 convolutions whose output is one real/fake logit
per overlapping patch, and the two GAN losses the VAE recipe offers.

Module names follow taming's `NLayerDiscriminator` (`main.0`, `main.2`, `main.3`, ...), so the
`loss.discriminator.*` weights of an original autoencoder training checkpoint load.
"""

import torch
import torch.nn.functional as F
from torch import nn


class NLayerDiscriminator(nn.Module):
    """PatchGAN: (B, in_channels, H, W) -> logits (B, 1, H', W'), H' ~ H/2**n_layers - 2.

    Args:
        input_nc: image channels (3; more for a conditional discriminator).
        ndf: width of the first layer, doubled per layer up to 8x.
        n_layers: number of stride-2 layers (3: a 70x70 receptive field).
        use_actnorm: accepted from the original configs; only false (BatchNorm) is supported.
    """

    def __init__(self, input_nc: int = 3, ndf: int = 64, n_layers: int = 3, use_actnorm=False):
        super().__init__()
        if use_actnorm:
            raise ValueError("lossconfig.params.use_actnorm: only false (BatchNorm) is supported")
        layers: list[nn.Module] = [nn.Conv2d(input_nc, ndf, 4, 2, 1), nn.LeakyReLU(0.2)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2**n, 8)
            stride = 2 if n < n_layers else 1  # the last widening layer keeps the resolution
            layers += [
                nn.Conv2d(ndf * prev, ndf * mult, 4, stride, 1, bias=False),
                nn.BatchNorm2d(ndf * mult),
                nn.LeakyReLU(0.2),
            ]
        layers.append(nn.Conv2d(ndf * mult, 1, 4, 1, 1))
        self.main = nn.Sequential(*layers)
        self.apply(_dcgan_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)  # (B, 1, H', W')


def _dcgan_init(module: nn.Module) -> None:
    """DCGAN initialisation (Radford et al. 2016), as taming's `weights_init`."""
    if isinstance(module, nn.Conv2d):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def hinge_d_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> torch.Tensor:
    """Hinge loss (Lim & Ye 2017): mean(relu(1 - D(x))) and mean(relu(1 + D(G(z)))), halved."""
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def vanilla_d_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> torch.Tensor:
    """Non-saturating GAN loss (Goodfellow et al. 2014) on logits, halved."""
    return 0.5 * (F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean())


DISC_LOSSES = {"hinge": hinge_d_loss, "vanilla": vanilla_d_loss}
