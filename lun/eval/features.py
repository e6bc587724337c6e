"""Feature extractors for FID / KID: images (B, 3, H, W) in [-1, 1] -> features (B, D).

- `InceptionV3`: the network FID is defined with - TensorFlow's 2015-12-05 Inception-v3 graph as
  ported by pytorch-fid (mseitzer/pytorch-fid, `fid_inception_v3`), 2048-d pool3 features.
  Written here (torchvision's Inception3 layout and parameter names, with the FID patches: the
  average pools leave padding out, the last block max-pools) because torchvision is never
  imported. It loads `pt_inception-2015-12-05-6726825d.pth` (pytorch-fid's release file) and
  torch-fidelity's `weights-inception-2015-12-05-6726825d.pth`, which use the same names.
- `SmallCNN`: a small classifier's penultimate features, for data sets Inception was not made
  for and machines without its weights (the shapes demo: scripts/shapes_features.py trains one).

`load_features(path)` builds the right one from the file. Its `identity` (kind, size and the
file's SHA-256) keys the cached reference statistics (lun.eval.reference).
"""

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ldm import safe_load

INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"
INCEPTION_URL = (
    "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + INCEPTION_FILE
)
WHERE_TO_GET = (
    f"download {INCEPTION_URL} (pytorch-fid's FID Inception weights; torch-fidelity's "
    "weights-inception-2015-12-05-6726825d.pth also works) on a machine with network access, or "
    "train a small classifier for your data (scripts/shapes_features.py shows how)"
)
SMALL_CNN = "lun.small_cnn"  # safetensors metadata `kind` of a SmallCNN file


def quantize(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> the nearest of the 256 levels an 8-bit PNG holds, so generated images are
    scored as they would be once saved, like the real images read from files."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1


# ------------------------------------------------------------------------------ Inception-v3


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _avg_pool(x):
    # TensorFlow's average pool leaves the zero padding out of the mean (pytorch-fid's patch).
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x):
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(_avg_pool(x))], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = x
        for i in range(1, 6):
            bd = getattr(self, f"branch7x7dbl_{i}")(bd)
        return torch.cat([self.branch1x1(x), b7, bd, self.branch_pool(_avg_pool(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = x
        for i in range(1, 5):
            b7 = getattr(self, f"branch7x7x3_{i}")(b7)
        return torch.cat([b3, b7, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionE(nn.Module):
    """`max_pool`: the FID graph's last block max-pools its pool branch (pytorch-fid's
    FIDInceptionE_2; "likely an error" of that graph, kept because FID is defined by it)."""

    def __init__(self, cin: int, max_pool: bool = False):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        pool = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _avg_pool(x)
        return torch.cat([self.branch1x1(x), b3, bd, self.branch_pool(pool)], 1)


class InceptionV3(nn.Module):
    """FID Inception-v3 -> 2048-d pool3 features. Images are resized bilinearly to `size`
    (299, as pytorch-fid; smaller only for tests - at least 75) and fed in [-1, 1]."""

    dim = 2048

    def __init__(self, size: int = 299):
        super().__init__()
        if size < 75:
            raise ValueError(f"InceptionV3 size={size}: needs at least 75 pixels")
        self.size = size
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, c7=128)
        self.Mixed_6c = InceptionC(768, c7=160)
        self.Mixed_6d = InceptionC(768, c7=160)
        self.Mixed_6e = InceptionC(768, c7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)  # in the weights file; not used for FID

    def forward(self, x):  # (B, 3, H, W) in [-1, 1]
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)  # (B, 192, 35, 35) at 299
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return x.mean(dim=(2, 3))  # (B, 2048) pool3


# ---------------------------------------------------------------------------------- SmallCNN


class SmallCNN(nn.Module):
    """A small image classifier; its features are the pooled last block, (B, widths[-1]).

    Each block: 3x3 conv - GroupNorm - SiLU, then a 2x down-sampling (none after the last)."""

    def __init__(self, num_classes: int, widths=(32, 64, 128), size: int = 16):
        super().__init__()
        self.size, self.widths, self.num_classes = size, tuple(widths), num_classes
        self.dim = self.widths[-1]
        layers, cin = [], 3
        for i, width in enumerate(self.widths):
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.GroupNorm(8, width), nn.SiLU()]
            if i < len(self.widths) - 1:
                layers.append(nn.AvgPool2d(2))
            cin = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(self.dim, num_classes)

    def forward(self, x):  # (B, 3, H, W) in [-1, 1] -> (B, dim)
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True)
        return self.body(x).mean(dim=(2, 3))

    def logits(self, x):
        return self.head(self(x))

    def metadata(self) -> dict[str, str]:
        """What `load_features` needs to rebuild it, for the safetensors header."""
        widths = ",".join(map(str, self.widths))
        return {"kind": SMALL_CNN, "widths": widths, "size": str(self.size)} | {
            "num_classes": str(self.num_classes)
        }


# ----------------------------------------------------------------------------------- loading


class FeatureExtractor(nn.Module):
    """A loaded feature network in eval mode without gradients; `identity` names its kind,
    input size and weights file (SHA-256), for cache keys and reports."""

    def __init__(self, net: nn.Module, identity: dict):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.identity = identity
        self.dim = net.dim

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, D) float32
        return self.net(quantize(images)).float()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_features_file(path: str | Path | None, key: str = "features") -> None:
    """A one-line ValueError naming `key`, the file and where to get it, when it is missing."""
    if path is None or not Path(path).is_file():
        raise ValueError(f"{key}={path}: feature-extractor weights not found; {WHERE_TO_GET}")


def _read_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    safe_load.check_readable(path)  # a damaged file or one holding code: one line naming it
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path)), metadata
    state = torch.load(path, map_location="cpu", weights_only=True)  # a plain tensor dict
    return state.get("state_dict", state), {}


def load_features(path: str | Path, size: int | None = None) -> FeatureExtractor:
    """The extractor stored in `path`: FID Inception-v3 (.pth / .safetensors of its weights,
    resized to `size` or 299) or a SmallCNN written by scripts/shapes_features.py."""
    check_features_file(path)
    path = Path(path)
    state, metadata = _read_state(path)
    if metadata.get("kind") == SMALL_CNN:
        widths = tuple(int(w) for w in metadata["widths"].split(","))
        net = SmallCNN(int(metadata["num_classes"]), widths, int(metadata["size"]))
        kind = SMALL_CNN
    elif "Mixed_7c.branch_pool.conv.weight" in state:
        net = InceptionV3(size or 299)
        kind = "inception-v3-fid"
        # Files written before BatchNorm counted its batches have no num_batches_tracked.
        for name, buffer in net.state_dict().items():
            if name.endswith("num_batches_tracked"):
                state.setdefault(name, buffer)
    else:
        raise ValueError(
            f"features={path}: neither FID Inception-v3 weights nor a SmallCNN file "
            f"(scripts/shapes_features.py); {WHERE_TO_GET}"
        )
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape that differs
        raise ValueError(f"features={path}: {str(err).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise ValueError(
            f"features={path}: {len(missing)} weights missing (e.g. {missing[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:2]})"
        )
    identity = {"kind": kind, "size": net.size, "sha256": file_sha256(path)}
    return FeatureExtractor(net, identity)


def identity_json(identity: dict) -> str:
    return json.dumps(identity, sort_keys=True)
