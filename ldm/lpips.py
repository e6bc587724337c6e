"""LPIPS perceptual distance (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features
as a Perceptual Metric", arXiv:1801.03924), VGG16 variant, written here and offline.

The VGG16 feature stack (Simonyan & Zisserman 2015) carries torchvision's parameter names
(`features.0.weight` ... `features.28.bias`), so the standard ImageNet file
(`vgg16-397923af.pth`) loads as it is; its `classifier.*` keys are not needed. The learned linear
heads (`lin0..lin4`, one 1x1 conv per tapped layer) are read from the `weights/v0.1/vgg.pth` file
that ships in the `lpips` wheel (installed with `--no-deps`, never imported; see
requirements-lpips.txt), or from a path given in the config.
"""

import importlib.util
import os

import torch
from torch import nn

from ldm.safe_load import load_file_state, state_dict_of

# torchvision's VGG16 `features`: output widths of the 13 convs, "M" a 2x2 max-pool.
VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512)
# Index (in `features`) just after relu1_2, relu2_2, relu3_3, relu4_3, relu5_3: the five taps.
TAP_ENDS = (4, 9, 16, 23, 30)
TAP_WIDTHS = (64, 128, 256, 512, 512)
# The LPIPS input normalisation: images in [-1, 1] -> ImageNet statistics (the original's
# ScalingLayer constants).
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
HEADS_FILE = os.path.join("weights", "v0.1", "vgg.pth")
RANDOM = "random"  # perceptual_weights value for tests: a random backbone (no meaning as a metric)
# Where torchvision caches the VGG16 ImageNet file (the original LPIPS loss fetched it there).
TORCHVISION_VGG16 = os.path.join("checkpoints", "vgg16-397923af.pth")


def default_vgg16_path() -> str | None:
    """torchvision's cached VGG16 ImageNet file under the torch hub folder, if it is there."""
    import torch.hub

    path = os.path.join(torch.hub.get_dir(), TORCHVISION_VGG16)
    return path if os.path.isfile(path) else None


def vgg16_features() -> nn.Sequential:
    """torchvision's `vgg16().features` layer for layer (same indices, so the same names)."""
    layers, width = [], 3
    for item in VGG16_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(width, item, 3, padding=1), nn.ReLU(inplace=False)]
            width = item
    return nn.Sequential(*layers)


def default_heads_path() -> str:
    """The linear heads inside the installed `lpips` package (found, not imported)."""
    spec = importlib.util.find_spec("lpips")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], HEADS_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "LPIPS: the linear heads weights/v0.1/vgg.pth were not found; install them with "
        "`pip install --no-deps -r requirements-lpips.txt`, or give lpips_heads: PATH"
    )


def _read(path: str, what: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LPIPS: {what} file {path} does not exist")
    return state_dict_of(load_file_state(path))


class LPIPS(nn.Module):
    """d(x, y) = sum_l mean_hw( w_l . (f_l(x)/|f_l(x)| - f_l(y)/|f_l(y)|)^2 ), images in [-1, 1].

    Frozen: it is a loss, its weights never train and are not saved with the model.

    Args:
        vgg_weights: torchvision's VGG16 ImageNet file (`.pth` / `.safetensors`), or "random"
            (tests only).
        heads: the LPIPS v0.1 linear heads file; None = the one inside the `lpips` package.
    """

    def __init__(self, vgg_weights: str, heads: str | None = None):
        super().__init__()
        self.features = vgg16_features()
        self.lins = nn.ModuleList(nn.Conv2d(w, 1, 1, bias=False) for w in TAP_WIDTHS)
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1), persistent=False)
        if vgg_weights != RANDOM:
            state = _read(vgg_weights, "VGG16 weights")
            features = {
                k.removeprefix("features."): v
                for k, v in state.items()
                if k.startswith("features.")
            }
            self.features.load_state_dict(features, strict=True)
            heads_state = _read(heads or default_heads_path(), "LPIPS heads")
            for i, lin in enumerate(self.lins):
                lin.weight.data.copy_(heads_state[f"lin{i}.model.1.weight"])
        else:
            # Nonnegative heads as the trained ones are (the distance stays >= 0).
            for lin in self.lins:
                nn.init.uniform_(lin.weight, 0.0, 0.1)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):
        return super().train(False)  # a fixed metric: no dropout, whatever the parent does

    def taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The five ReLU outputs (B, C_l, H_l, W_l), in float32 for the distance."""
        h = (x - self.shift) / self.scale
        out, start = [], 0
        for end in TAP_ENDS:
            h = self.features[start:end](h)
            out.append(h.float())
            start = end
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) x2 -> distance (B, 1, 1, 1)."""
        # The VGG convolutions run in the ambient (autocast) precision; the distance in float32:
        # the channel sum of squares of VGG's deep activations overflows float16.
        taps_x, taps_y = self.taps(x), self.taps(y)
        total = 0.0
        with torch.autocast(x.device.type, enabled=False):
            for lin, fx, fy in zip(self.lins, taps_x, taps_y, strict=True):
                diff = (unit_normalize(fx) - unit_normalize(fy)) ** 2
                total = total + lin(diff).mean(dim=(2, 3), keepdim=True)
        return total


def unit_normalize(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """x / ||x||_2 over channels, as LPIPS (eps added to the norm, not inside the root)."""
    return x / (torch.sqrt((x * x).sum(dim=1, keepdim=True)) + eps)
