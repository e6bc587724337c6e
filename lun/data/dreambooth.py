"""lun.data.dreambooth.DreamBooth: a few images of one subject, and (optionally) prior preservation.

DreamBooth (Ruiz et al. 2022, arXiv:2208.12242) fine-tunes on 3-5 images of a subject captioned
with a rare token ("a photo of sks dog"). Trained on those alone, the model drifts: every "dog"
becomes that dog, and the class loses its variety. The class-specific prior preservation loss
(their eq. 2) trains at the same time on images the *base* model drew for the class prompt
("a photo of dog"), so what the model knew of the class is kept:

    E[ ||x_hat(x_t, c) - x||^2 ] + lambda E[ ||x_hat(x_pr_t', c_pr) - x_pr||^2 ]

    data_root/**/<image>          the subject (instance images), captioned `instance_prompt`
    class_data_root/**/<image>    the class, captioned `class_prompt`; the missing ones up to
                                  `num_class_images` are drawn from `class_model` before
                                  the data is built (lun.prior_images, called by the
                                  launcher) and kept there, so the next run reuses them

As in diffusers' train_dreambooth(_lora).py, each item pairs an instance image with a class image
(instance i mod N_instance, class i mod N_class; max(N_instance, N_class) items), and `collate`
makes a batch of B items into 2B images: the B instance images, then the B class images, with a
per-image `loss_weight` that `ldm.diffusion.LatentDiffusion` multiplies into the per-sample loss.
"""

import logging
import os

import torch

from lun.data.images import (
    CROPS,
    DEFAULT_MAX_PIXELS,
    INTERPOLATIONS,
    ImageError,
    check_choice,
    check_max_pixels,
    load_image_tensor,
)
from lun.data.index import is_image, walk
from lun.data.report import MAX_FRESH_FAILURES, BadInputLog

logger = logging.getLogger("lun.data")


def _list_images(root: str) -> list[str]:
    """The images under `root`; zero-byte files and broken links are named in the log, left out."""
    unusable, images, captions = [], [], 0
    for rel, size, _ in walk(root, unusable):
        captions += rel.lower().endswith(".txt")
        if is_image(rel) and size == 0:
            unusable.append((rel, "zero bytes", "an empty file"))
        elif is_image(rel):
            images.append(os.path.join(root, rel))
    for rel, reason, detail in unusable:
        if is_image(rel):
            logger.warning("skipped %s: %s (%s)", os.path.join(root, rel), reason, detail)
    if captions:  # per-image captions, which this dataset does not read: say so
        logger.warning(
            "%s: its %d .txt files are not read - DreamBooth captions every image with its "
            "prompt (per-image captions train with lun.data.local.Local)",
            root,
            captions,
        )
    return images


def check_instance_settings(data_root, instance_prompt) -> None:
    """ValueError naming the instance setting that is wrong."""
    if not isinstance(data_root, str) or not os.path.isdir(data_root):
        raise ValueError(f"data_root={data_root!r}: not a folder (the instance images)")
    if not isinstance(instance_prompt, str) or not instance_prompt.strip():
        raise ValueError(f"instance_prompt={instance_prompt!r}: expected the subject's caption")


def class_images(class_data_root: str) -> list[str]:
    """The images in the class folder, by name (none when it does not exist yet)."""
    return _list_images(class_data_root) if os.path.isdir(class_data_root) else []


def check_class_settings(
    class_data_root,
    class_prompt,
    num_class_images,
    prior_loss_weight,
    class_model,
    sample_steps,
    sample_batch_size,
) -> None:
    """ValueError naming the first prior-preservation setting that is wrong (checked before
    anything is drawn: by the drawing step, then by the dataset)."""
    if not isinstance(class_data_root, str) or os.path.isfile(class_data_root):
        raise ValueError(f"class_data_root={class_data_root!r}: expected a folder")
    if not isinstance(class_prompt, str) or not class_prompt.strip():
        raise ValueError(
            f"class_prompt={class_prompt!r}: prior preservation needs the class's "
            "caption (e.g. 'a photo of dog')"
        )
    if num_class_images is not None:
        _positive("num_class_images", num_class_images, int)
    _positive("prior_loss_weight", prior_loss_weight)
    if class_model is not None and not (isinstance(class_model, dict) and "target" in class_model):
        raise ValueError("class_model: expected a model config with a target, e.g. ${model}")
    for name, value in (("sample_steps", sample_steps), ("sample_batch_size", sample_batch_size)):
        _positive(name, value, int)


def _positive(name: str, value, kind=(int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{name}={value!r}: expected {what} > 0")


class DreamBooth(torch.utils.data.Dataset):
    """Instance images with one prompt, paired with class images for prior preservation.

    data_root: the folder of the subject's images (any layout below it).
    instance_prompt: the caption of every instance image, with the rare token ("a sks dog").
    class_data_root: the folder of class images; None = no prior preservation (instance only).
    class_prompt: the caption of the class images ("a dog"); needed with class_data_root.
    num_class_images: class images to use (the first, by name); with `class_model` the launcher
        draws the missing ones first (lun.prior_images). Default: those in class_data_root.
    prior_loss_weight: lambda of eq. 2, the weight of the class images' loss (diffusers: 1.0).
    class_model: the model config (`target`/`params`) to draw missing class images with - the
        base model, usually `${model}` (a LoRA starts as the base). Drawn at `size`, DDIM with
        `sample_steps` steps and guidance `sample_scale`, `sample_batch_size` at a time, on the
        first GPU when there is one; image i from seed i. None: class_data_root must be full.
    size, interpolation, flip_p, crop, max_image_pixels: as in `lun.data.local.Local`.
    """

    def __init__(
        self,
        data_root: str,
        instance_prompt: str,
        class_data_root: str | None = None,
        class_prompt: str | None = None,
        num_class_images: int | None = None,
        prior_loss_weight: float = 1.0,
        class_model: dict | None = None,
        sample_steps: int = 50,
        sample_scale: float = 7.5,
        sample_batch_size: int = 4,
        size: int = 512,
        interpolation: str = "bicubic",
        flip_p: float = 0.0,
        crop: str = "center",
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ):
        # Every value is checked before anything is drawn or the run folder exists.
        check_instance_settings(data_root, instance_prompt)
        self.size, self.flip_p = size, flip_p
        self.max_image_pixels = check_max_pixels(max_image_pixels)
        self.interpolation = check_choice("interpolation", interpolation, INTERPOLATIONS)
        self.crop = check_choice("crop", crop, CROPS)
        self.instance_prompt, self.class_prompt = instance_prompt, class_prompt
        self.prior_loss_weight = prior_loss_weight
        self.instance_images = _list_images(data_root)
        if not self.instance_images:
            raise ValueError(f"data_root={data_root!r}: no images in it")
        self.class_images: list[str] = []
        if class_data_root is not None:
            check_class_settings(
                class_data_root,
                class_prompt,
                num_class_images,
                prior_loss_weight,
                class_model,
                sample_steps,
                sample_batch_size,
            )
            found = class_images(class_data_root)
            wanted = num_class_images or len(found)
            if len(found) < wanted:
                way = (
                    "draw them first: lun.prior_images.draw_missing_class_images(data config), "
                    "as main.py does before building the data"
                    if class_model is not None
                    else "add images, or set class_model (e.g. ${model}) to draw the rest from "
                    "the base model"
                )
                raise ValueError(
                    f"class_data_root={class_data_root!r}: {len(found)} images, "
                    f"num_class_images={wanted}; {way}"
                )
            self.class_images = found[:wanted]
        elif class_prompt is not None or num_class_images is not None:
            raise ValueError(
                "class_data_root: missing; class_prompt / num_class_images need the class folder"
            )
        self.bad_input = BadInputLog(data_root)
        self.bad_input.track_items(len(self.instance_images) + len(self.class_images))
        prior = f", {len(self.class_images)} class images (prior preservation)"
        logger.info(
            "%s: %d instance images%s", data_root, len(self.instance_images), prior * self.prior
        )

    @property
    def prior(self) -> bool:
        """Prior preservation on: items pair an instance image with a class image."""
        return bool(self.class_images)

    def __len__(self) -> int:
        return max(len(self.instance_images), len(self.class_images))

    def _load(self, paths: list[str], index: int, offset: int) -> torch.Tensor:
        """Image `index` of `paths`, or the next readable one (bad ones named once in the log);
        `offset` places `paths` in the shared failure flags."""
        for step in range(min(len(paths), MAX_FRESH_FAILURES)):
            candidate = (index + step) % len(paths)
            if self.bad_input.is_known_bad(offset + candidate):
                continue
            try:
                return load_image_tensor(
                    paths[candidate],
                    (self.size, self.size),
                    self.interpolation,
                    self.crop,
                    self.flip_p,
                    max_pixels=self.max_image_pixels,
                )
            except (ImageError, OSError) as err:
                self.bad_input.load_failed(offset + candidate, paths[candidate], err)
        raise RuntimeError(f"{os.path.dirname(paths[index])}: no readable image left near {index}")

    def __getitem__(self, index: int) -> dict:
        n = len(self.instance_images)
        item = {"image": self._load(self.instance_images, index % n, 0)}
        item["caption"] = self.instance_prompt
        if self.prior:
            i = index % len(self.class_images)
            item["class_image"] = self._load(self.class_images, i, n)
            item["class_caption"] = self.class_prompt
        return item

    def collate(self, items: list[dict]) -> dict:
        """B items -> one batch of the B instance images, then (with prior preservation) the B
        class images, and each image's `loss_weight`.

        Eq. 2 as diffusers computes it: mean(instance losses) + lambda * mean(class losses).
        The model averages weight * loss over all 2B images, so the weights are 2 and 2 lambda.
        """
        images = [item["image"] for item in items]
        captions = [item["caption"] for item in items]
        if not self.prior:
            return {"image": torch.stack(images), "caption": captions}
        images += [item["class_image"] for item in items]
        captions += [item["class_caption"] for item in items]
        b = len(items)
        weight = torch.tensor([2.0] * b + [2.0 * self.prior_loss_weight] * b)
        return {"image": torch.stack(images), "caption": captions, "loss_weight": weight}

    def check_readable(self) -> None:
        """Decode the first instance (and class) image; the launcher calls this before the run
        folder exists, so a folder of unreadable files stops there."""
        self._load(self.instance_images, 0, 0)
        if self.prior:
            self._load(self.class_images, 0, len(self.instance_images))
