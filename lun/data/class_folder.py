"""lun.data.class_folder.ClassFolder: an ImageNet-style class-folder dataset for class-conditional
models (DiT).

    data_root/<class>/**/<name>.<png|jpg|jpeg|webp|bmp>     e.g. train/n01440764/n01440764_10026.JPEG

Class ids follow the sorted folder names, as torchvision's ImageFolder numbers them - and so DiT's
train.py, whose released ImageNet model expects n01440764 = 0 ... n15075141 = 999. Items are
{"image": (3, H, W) in [-1, 1], "label": int, "caption": the class's name}; the label feeds
`ldm.conditioning.ClassLabels`, the caption names the class in logs and lets a text-conditional
model train on the same folders. An image that cannot be read is replaced by another of the
same folder walk and named once in the log; training goes on.
"""

import json
import logging
import os

import torch

from lun.data.images import (
    CROPS,
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    INTERPOLATIONS,
    ImageError,
    check_choice,
    check_max_pixels,
    load_image_tensor,
)
from lun.data.index import walk
from lun.data.report import MAX_FRESH_FAILURES, BadInputLog

logger = logging.getLogger("lun.data")


def load_class_names(idx_to_prompt, folders: list[str]) -> list[str]:
    """The name of each class id: from `idx_to_prompt` (a JSON file or mapping/list, id -> name
    or list of names, the first taken) where given, else the folder's name."""
    if idx_to_prompt is None:
        return list(folders)
    if isinstance(idx_to_prompt, str):
        with open(idx_to_prompt, encoding="utf-8") as file:
            idx_to_prompt = json.load(file)
    if isinstance(idx_to_prompt, list):
        idx_to_prompt = dict(enumerate(idx_to_prompt))
    names = {int(k): v if isinstance(v, str) else str(v[0]) for k, v in idx_to_prompt.items()}
    return [names.get(i, folder) for i, folder in enumerate(folders)]


class ClassFolder(torch.utils.data.Dataset):
    """Images under one folder per class; items {"image", "label", "caption"}.

    data_root: the folder holding one sub-folder per class.
    size: output side in pixels (resize to cover, then crop).
    interpolation, crop, flip_p, max_image_pixels: as in `lun.data.local.Local`.
    idx_to_prompt: class names for captions and logs (ImageNet: id -> "tench", ...); a JSON file
        or an inline mapping/list. Default: the folder names.
    """

    def __init__(
        self,
        data_root: str,
        size: int = 256,
        interpolation: str = "bicubic",
        crop: str = "center",
        flip_p: float = 0.0,
        idx_to_prompt=None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ):
        if not isinstance(data_root, str) or not os.path.isdir(data_root):
            raise ValueError(f"data_root={data_root!r}: expected a folder of class folders")
        self.data_root, self.size, self.flip_p = data_root, size, flip_p
        self.interpolation = check_choice("interpolation", interpolation, INTERPOLATIONS)
        self.crop = check_choice("crop", crop, CROPS)
        self.max_image_pixels = check_max_pixels(max_image_pixels)
        self.classes = sorted(
            entry.name
            for entry in os.scandir(data_root)
            if entry.is_dir() and not entry.name.startswith(".")
        )
        if not self.classes:
            raise ValueError(f"data_root={data_root!r} has no class folders (<class>/<image>)")
        self.class_names = load_class_names(idx_to_prompt, self.classes)
        self.samples: list[tuple[str, int]] = []
        for label, folder in enumerate(self.classes):
            unusable, found = [], len(self.samples)
            for rel, size_bytes, _ in walk(os.path.join(data_root, folder), unusable):
                if not rel.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                if size_bytes == 0:
                    unusable.append((rel, "zero bytes", "an empty file"))
                    continue
                self.samples.append((os.path.join(folder, rel), label))
            for rel, reason, detail in unusable:
                if rel.lower().endswith(IMAGE_EXTENSIONS):
                    path = os.path.join(data_root, folder, rel)
                    logger.warning("skipped %s: %s (%s)", path, reason, detail)
            if len(self.samples) == found:  # its class id exists, and is never trained
                logger.warning("%s: class %d (%s) has no images", data_root, label, folder)
        if not self.samples:
            raise ValueError(
                f"data_root={data_root!r}: no images in its {len(self.classes)} class folders"
            )
        self.bad_input = BadInputLog(data_root)
        self.bad_input.track_items(len(self.samples))
        logger.info("%s: %d images in %d classes", data_root, len(self.samples), len(self.classes))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        """Item `index`, or the next readable one if its image cannot be read."""
        fresh_failures = 0
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            if self.bad_input.is_known_bad(candidate):
                continue
            rel, label = self.samples[candidate]
            path = os.path.join(self.data_root, rel)
            try:
                image = load_image_tensor(
                    path,
                    (self.size, self.size),
                    self.interpolation,
                    self.crop,
                    self.flip_p,
                    max_pixels=self.max_image_pixels,
                )
            except (ImageError, OSError) as err:
                self.bad_input.load_failed(candidate, path, err)
                fresh_failures += 1
                if fresh_failures >= MAX_FRESH_FAILURES:
                    break
                continue
            return {"image": image, "label": label, "caption": self.class_names[label]}
        raise RuntimeError(f"{self.data_root}: {fresh_failures} images in a row failed to load")
