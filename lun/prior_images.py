"""DreamBooth's class images, drawn by the base model before the data is built.

Prior preservation (Ruiz et al. 2022, arXiv:2208.12242, eq. 2) trains on images the *base*
model drew for the class prompt. Drawing needs a model, and the data never knows the model
(lun.data reads folders): so the launcher calls `draw_missing_class_images(data config)` first
(`lun.trainer.build_data`), which fills each DreamBooth dataset's `class_data_root` up to
`num_class_images` with images drawn by its `class_model` (usually `${model}`); the dataset
then reads the folder.

Image i is `class-<i>.png` from seed i (DDIM, `sample_steps`, guidance `sample_scale`,
`sample_batch_size` at a time, on the first accelerator when there is one), so an interrupted
run continues with the same images. Each file is written whole (temporary name, then renamed),
with its parameters in the PNG text chunk as txt2img writes them.
"""

import inspect
import itertools
import logging
import os
import types
from collections.abc import Mapping

import torch

from ldm.util import get_obj_from_str
from lun.data.dreambooth import (
    DreamBooth,
    check_class_settings,
    check_instance_settings,
    class_images,
)

logger = logging.getLogger("lun.data")
CLASS_IMAGE_NAME = "class-{:05d}.png"  # image i is drawn from seed i


def draw_missing_class_images(data_config: Mapping) -> list[str]:
    """Draw the class images every DreamBooth dataset of `data_config` (a `lun.data.DataModule`
    config) lacks; its settings are checked first (ValueError naming the key). Returns the
    new paths."""
    written = []
    for split in ("train", "validation", "test"):
        dataset = ((data_config or {}).get("params") or {}).get(split)
        if isinstance(dataset, Mapping):
            written += _fill(dataset)
    return written


def _fill(dataset: Mapping) -> list[str]:
    target = dataset.get("target")
    try:
        cls = get_obj_from_str(target) if isinstance(target, str) else None
    except (ImportError, AttributeError, ValueError):
        return []  # the data's own build names the unknown target
    if not (isinstance(cls, type) and issubclass(cls, DreamBooth)):
        return []
    try:
        bound = inspect.signature(DreamBooth).bind(**(dataset.get("params") or {}))
    except TypeError:
        return []  # an unknown or missing parameter: named when the dataset is built
    bound.apply_defaults()
    p = types.SimpleNamespace(**bound.arguments)
    if p.class_data_root is None or p.class_model is None:
        return []
    check_instance_settings(p.data_root, p.instance_prompt)
    check_class_settings(
        p.class_data_root,
        p.class_prompt,
        p.num_class_images,
        p.prior_loss_weight,
        p.class_model,
        p.sample_steps,
        p.sample_batch_size,
    )
    wanted = p.num_class_images or len(class_images(p.class_data_root))
    if len(class_images(p.class_data_root)) >= wanted:
        return []
    sampling = types.SimpleNamespace(
        steps=p.sample_steps, scale=p.sample_scale, batch_size=p.sample_batch_size
    )
    return draw_class_images(
        p.class_model, p.class_data_root, p.class_prompt, wanted, p.size, sampling
    )


@torch.no_grad()
def draw_class_images(
    model_config: dict, folder: str, prompt: str, count: int, size: int, sampling
) -> list[str]:
    """Fill `folder` up to `count` images of `prompt`, drawn by the model `model_config` builds
    (its `ckpt_path` loaded): image i is `class-<i>.png` from seed i, so an interrupted run
    continues with the same images. Each file is written whole (temporary name, then renamed),
    with its parameters in the PNG text chunk as txt2img writes them. Returns the new paths."""
    from ldm.checkpoint import file_hash
    from ldm.util import instantiate_from_config
    from lun.generation import a1111_parameters, pick_device, save_png, starting_noise, to_pil

    os.makedirs(folder, exist_ok=True)
    missing = count - len(class_images(folder))
    todo = []  # (seed, path) of the first free names
    for i in itertools.count():
        if len(todo) >= missing:
            break
        path = os.path.join(folder, CLASS_IMAGE_NAME.format(i))
        if not os.path.exists(path):
            todo.append((i, path))
    if not todo:
        return []
    device = pick_device(None)
    logger.info("drawing %d class images of %r into %s on %s", len(todo), prompt, folder, device)
    model = instantiate_from_config(model_config).eval().to(device)
    ckpt = (model_config.get("params") or {}).get("ckpt_path")
    model_hash = file_hash(ckpt) if ckpt else "none"
    latent_shape = model.latent_shape(size, size)
    args = types.SimpleNamespace(
        sampler="ddim", karras=False, steps=sampling.steps, scale=sampling.scale
    )
    written = []
    for first in range(0, len(todo), sampling.batch_size):
        chunk = todo[first : first + sampling.batch_size]
        seeds = [i for i, _ in chunk]
        images = model.sample(
            [prompt] * len(chunk),
            height=size,
            width=size,
            sampler="ddim",
            steps=sampling.steps,
            scale=sampling.scale,
            noise=starting_noise(seeds, latent_shape, device),
        )
        for (seed, path), image in zip(chunk, images):
            # hidden (the folder listing skips it) and still a .png for PIL
            temporary = os.path.join(
                folder, "." + os.path.basename(path).replace(".png", ".tmp.png")
            )
            params = a1111_parameters(prompt, "", args, seed, size, size, model_hash)
            save_png(to_pil(image), temporary, params)
            os.replace(temporary, path)  # a crash leaves no half image that counts as one
            written.append(path)
        logger.info("class images: %d of %d drawn", len(written), len(todo))
    return written
