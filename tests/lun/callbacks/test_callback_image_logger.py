import json

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from callback_testing import IMAGE_SIZE, trainable_weights
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lun.callbacks.ema import EMA, find_ema
from lun.callbacks.image_logger import ImageLogger
from lun.images import make_grid


def test_make_grid_layout_and_values():
    images = torch.zeros(5, 3, 2, 3)
    images[0] = -1.0
    images[1] = 1.0
    grid = make_grid(images, nrow=3, padding=2)
    assert grid.shape == (2 * (2 + 2) + 2, 3 * (3 + 2) + 2, 3) and grid.dtype == np.uint8
    assert (grid[2:4, 2:5] == 0).all()  # image 0: -1 -> 0
    assert (grid[2:4, 7:10] == 255).all()  # image 1: +1 -> 255
    assert (grid[6:8, 2:5] == 128).all()  # image 3 (second row): 0 -> 128
    assert (grid[6:8, 12:15] == 0).all() and (grid[0:2] == 0).all()  # empty slot and padding


def test_make_grid_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="N, C, H, W"):
        make_grid(torch.zeros(3, 8, 8))


def test_grids_are_written_as_png_and_to_tensorboard(make_module, make_loader, fit, tmp_path):
    logger = ImageLogger(
        batch_frequency=2,
        max_images=3,
        prompts=["a cat", "a dog"],
        steps=4,
        log_first_step=True,
        reconstructions=True,
        use_ema=False,
    )
    tensorboard = TensorBoardLogger(str(tmp_path / "tb"), name="", version="")
    fit(make_module(), [logger], make_loader(), max_steps=4, logger=tensorboard)

    folder = tmp_path / "images" / "train"
    for step in (0, 2, 4):
        for kind in ("samples", "inputs", "reconstructions"):
            assert (folder / f"{kind}_gs-{step:06d}_e-000000.png").exists(), (kind, step)
    assert len(list(folder.iterdir())) == 9

    png = Image.open(folder / "samples_gs-000002_e-000000.png")
    assert png.size[::-1] == make_grid(torch.zeros(3, 3, IMAGE_SIZE, IMAGE_SIZE), nrow=3).shape[:2]
    settings = json.loads(png.text["parameters"])
    assert (
        settings["prompts"] == ["a cat", "a dog", "a cat"]
        and settings["step"] == 2
        and settings["seed"] == 0
    )

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"train/samples", "train/inputs", "train/reconstructions"} <= set(
        events.Tags()["images"]
    )
    assert [e.step for e in events.Images("train/samples")] == [0, 2, 4]


def test_log_steps_with_increase_log_steps():
    logger = ImageLogger(batch_frequency=100, increase_log_steps=True)
    assert [s for s in range(0, 301) if logger.is_due(s)] == [1, 2, 4, 8, 16, 32, 64, 100, 200, 300]


class Probe(pl.Callback):
    """Wraps `log_images` to see the weights it samples with and to use the global RNG."""

    def __init__(self):
        self.calls = []

    def on_train_start(self, trainer, pl_module):
        original = pl_module.log_images

        def log_images(*args, **kwargs):
            ema = find_ema(trainer)
            self.calls.append(
                (
                    trainer.global_step,
                    pl_module.training,
                    trainable_weights(pl_module),
                    {n: s.clone() for n, s in ema.shadows.items()},
                )
            )
            torch.rand(100)  # a sampler that draws from the global RNG must not change training
            return original(*args, **kwargs)

        pl_module.log_images = log_images


def test_samples_use_ema_weights_and_leave_training_untouched(
    make_module, make_loader, fit, tmp_path
):
    probe = Probe()
    with_images, without_images = make_module(), make_module()
    ema_a, ema_b = EMA(decay=0.9), EMA(decay=0.9)
    torch.manual_seed(1234)  # both runs start from the same global RNG state
    fit(
        with_images,
        [ema_a, probe, ImageLogger(batch_frequency=2, prompts=["x"], steps=2)],
        make_loader(),
        max_steps=4,
    )
    torch.manual_seed(1234)
    fit(without_images, [ema_b], make_loader(), max_steps=4)

    assert [step for step, *_ in probe.calls] == [2, 4]
    for _, training, weights, shadows in probe.calls:
        assert not training
        assert all(torch.equal(weights[n], shadows[n]) for n in weights)
    a, b = trainable_weights(with_images), trainable_weights(without_images)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(ema_a.shadows[n], ema_b.shadows[n]) for n in a)
