"""Is the validation set held out? A warning when validation images are also training images.

A validation loss on images the model trains on measures memorisation, not generalisation, and
falls when the model overfits. The held-out splits are a separate folder, or one folder split by
its metadata files: `consider_every_nth: n` for validation and `exclude_every_nth: n` for
training (lun.data.metadata). Configs written for translunar-diffusion validate on every 8th file
of the training folder without leaving it out of training; they keep working, with this warning.
"""

import logging
import os

logger = logging.getLogger("lun.data")


def _unwrapped(dataset):
    return getattr(dataset, "dataset", dataset)  # lun.data.latent_cache.CachedLatents wraps one


def image_paths(dataset) -> set[str] | None:
    """The real paths of a dataset's images, or None when it cannot tell (a stream, a dataset
    without `data_root` and `image_name`)."""
    dataset = _unwrapped(dataset)
    root, name = getattr(dataset, "data_root", None), getattr(dataset, "image_name", None)
    if not isinstance(root, str) or name is None:
        return None
    root = os.path.realpath(root)
    return {os.path.join(root, name(i)) for i in range(len(dataset))}


def check_held_out(train, validation) -> int:
    """Warn (logger "lun.data") when validation images are training images too; returns how
    many are. Only folders that can overlap are compared (the same, or one inside the other)."""
    roots = [getattr(_unwrapped(d), "data_root", None) for d in (train, validation)]
    if not all(isinstance(root, str) for root in roots):
        return 0
    a, b = (os.path.realpath(root) for root in roots)
    if os.path.commonpath([a, b]) not in (a, b):  # disjoint folders: nothing to compare
        return 0
    seen, held = image_paths(train), image_paths(validation)
    if seen is None or held is None:
        return 0
    shared = len(seen & held)
    if shared:
        logger.warning(
            "data.params.validation: %d of its %d images are also training images, so val/loss "
            "is not a held-out figure; use another folder, or split one folder with "
            "metadata_params.consider_every_nth: N (validation) and exclude_every_nth: N (train)",
            shared,
            len(held),
        )
    return shared
