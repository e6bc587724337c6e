"""Features of a real image set, computed once and cached on disk under a content hash.

The reference of FID / KID is the feature set of real images. Extracting it costs as much as
scoring thousands of generated images, so it is stored as `reference-<hash>.safetensors` (the
features (N, D) float32) in the cache folder; the hash covers what the features depend on - the
bytes of every image file, how they are read (the dataset config, size), the extractor (kind,
input size, SHA-256 of its weights file) and the image count - so a rerun reuses it and any
change recomputes it. The folder's location is not in the hash: a moved copy still matches.

A reference is a folder of images (any depth; resized to cover `size` and centre-cropped) or a
dataset config `{target, params}` (`lun.data.local.Local`, `lun.data.class_folder.ClassFolder`,
...) whose items hold an "image" in [-1, 1]; its `flip_p` is set to 0.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from lun.data.images import IMAGE_EXTENSIONS, load_image_tensor
from lun.data.index import walk

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
    """$LUN_CACHE_DIR/eval, else $XDG_CACHE_HOME/lun/eval, else ~/.cache/lun/eval."""
    if os.environ.get("LUN_CACHE_DIR"):
        return os.path.join(os.environ["LUN_CACHE_DIR"], "eval")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lun", "eval")


class ImageFolder(torch.utils.data.Dataset):
    """Every image under `folder` (sorted, any depth) as {"image": (3, size, size) in [-1, 1]}."""

    def __init__(self, folder: str, size: int):
        if not os.path.isdir(folder):
            raise ValueError(f"reference={folder}: not a folder of images")
        self.data_root, self.size = folder, size
        self.files = [rel for rel, n, _ in walk(folder) if rel.lower().endswith(IMAGE_EXTENSIONS)]
        if not self.files:
            raise ValueError(f"reference={folder}: no images in it ({', '.join(IMAGE_EXTENSIONS)})")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        path = os.path.join(self.data_root, self.files[index])
        return {"image": load_image_tensor(path, (self.size, self.size))}


def build_reference(spec, size: int) -> tuple[torch.utils.data.Dataset, dict]:
    """The dataset of a reference spec and the description its hash starts from."""
    if isinstance(spec, (str, Path)):
        return ImageFolder(str(spec), size), {"folder": True, "size": size}
    if not isinstance(spec, dict) or "target" not in spec:
        raise ValueError(f"reference={spec!r}: expected a folder or a dataset {{target, params}}")
    from ldm.util import instantiate_from_config

    params = dict(spec.get("params") or {})
    if "flip_p" in params:
        params["flip_p"] = 0.0  # the reference is the data as it is
    dataset = instantiate_from_config({"target": spec["target"], "params": params})
    described = {k: v for k, v in params.items() if k not in ("data_root", "cache_dir")}
    return dataset, {"target": spec["target"], "params": described}


def content_hash(dataset, description: dict, identity: dict, max_images: int | None) -> str:
    """SHA-256 of the description, the extractor's identity, the image count and the bytes of
    every image file under the dataset's `data_root`."""
    digest = hashlib.sha256()
    header = {"reference": description, "features": identity, "max_images": max_images}
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    root = getattr(dataset, "data_root", None)
    if root is None:
        raise ValueError("reference: the dataset has no data_root whose files could be hashed")
    for rel, _, _ in walk(root):
        if rel.lower().endswith(IMAGE_EXTENSIONS):
            digest.update(rel.encode() + b"\0")
            with open(os.path.join(root, rel), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


@torch.no_grad()
def extract(extractor, images, batch_size: int = 32) -> np.ndarray:
    """Features (N, D) float32 of a dataset's images or an (N, 3, H, W) tensor, in batches."""
    device = next(extractor.parameters()).device
    out = []
    if isinstance(images, torch.Tensor):
        for start in range(0, len(images), batch_size):
            out.append(extractor(images[start : start + batch_size].to(device)).cpu())
    else:
        loader = torch.utils.data.DataLoader(images, batch_size=batch_size, num_workers=0)
        for batch in loader:
            out.append(extractor(batch["image"].to(device)).cpu())
    return torch.cat(out).numpy().astype(np.float32)


def reference_features(
    spec,
    extractor,
    size: int,
    cache_dir: str | None = None,
    max_images: int | None = None,
    batch_size: int = 32,
) -> tuple[np.ndarray, Path, bool]:
    """(features (N, D), cache file, whether it was cached) of the reference `spec`; at most
    `max_images` images (the first ones, in the dataset's order)."""
    dataset, description = build_reference(spec, size)
    key = content_hash(dataset, description, extractor.identity, max_images)
    path = Path(cache_dir or default_cache_dir()) / f"reference-{key[:24]}.safetensors"
    if path.is_file():
        return load_file(str(path))["features"], path, True
    if max_images is not None and max_images < len(dataset):
        dataset = torch.utils.data.Subset(dataset, range(max_images))
    logger.info("reference statistics: %d images -> %s", len(dataset), path)
    features = extract(extractor, dataset, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    metadata = {"features": json.dumps(extractor.identity), "count": str(len(features))}
    save_file({"features": features}, str(temporary), metadata=metadata)
    os.replace(temporary, path)  # a reader sees the whole file or none
    return features, path, False
