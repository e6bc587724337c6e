"""LatentDiffusion logs `train/loss` only where someone reads it (issue 30: Lightning's
`self.log` costs ~1.5 % of a tiny step): on the steps that write logs - the same values as
logging every step - on the last step (what `trainer.callback_metrics` holds after the fit), and
on every step when a callback monitors it."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from trainer_helpers import quiet_trainer

from ldm.util import instantiate_from_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny" / "ldm.yaml"


class StepLosses(pl.Callback):
    """Each optimizer step's own loss (what `training_step` returned), by step number (1-based)."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def fit_tiny(tmp_path, steps: int, every: int, callbacks=(), by_epochs: bool = False):
    """The tiny LDM on cached latents (`steps` batches of 2: one epoch); returns (trainer, steps
    whose train/loss was logged, each step's loss). `by_epochs`: ends by max_epochs=1, not
    max_steps."""
    torch.manual_seed(0)
    model = instantiate_from_config(OmegaConf.load(TINY)["model"])
    model.learning_rate = 1e-3
    logged_at: list[int] = []
    log = model.log

    def counted_log(name, value, *args, **kwargs):  # notes the step, then logs as ever
        if name == "train/loss":
            logged_at.append(model.trainer.global_step + 1)
        return log(name, value, *args, **kwargs)

    model.log = counted_log
    items = [{"latent": torch.randn(4, 8, 8), "caption": f"shape {i}"} for i in range(2 * steps)]
    end = {"max_epochs": 1} if by_epochs else {"max_steps": steps}
    losses = StepLosses()
    trainer = quiet_trainer(
        log_every_n_steps=every,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[losses, *callbacks],
        enable_checkpointing=bool(callbacks),
        default_root_dir=tmp_path,
        **end,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight over a shared machine
    try:
        trainer.fit(model, DataLoader(items, batch_size=2))
    finally:
        torch.set_num_threads(threads)
    return trainer, logged_at, losses.losses


@pytest.mark.parametrize("by_epochs", [False, True])
def test_the_loss_is_logged_on_logging_steps_and_the_last_with_each_steps_value(
    tmp_path, by_epochs
):
    trainer, logged_at, losses = fit_tiny(tmp_path, steps=7, every=3, by_epochs=by_epochs)
    # Lightning writes logs when (step + 1) % every == 0 (0-based): steps 3 and 6 (1-based).
    assert logged_at == [3, 6, 7]
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    written = {int(row["step"]) + 1: float(row["train/loss"]) for row in rows}
    assert written.keys() == {3, 6}
    for step, value in written.items():  # the value of that step itself
        assert abs(value - losses[step]) <= 1e-6 * abs(losses[step]), (step, value, losses)
    assert float(trainer.callback_metrics["train/loss"]) == losses[7]


def test_a_monitored_loss_is_logged_every_step(tmp_path):
    # Saves at steps 2 and 4 rank by train/loss, with logs written only every 50 steps.
    best = ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", every_n_train_steps=2)
    trainer, logged_at, losses = fit_tiny(tmp_path, steps=4, every=50, callbacks=[best])
    assert logged_at == [1, 2, 3, 4]
    assert best.best_model_score is not None
    assert float(best.best_model_score) == min(losses[2], losses[4])


def test_the_autoencoder_logs_its_losses_only_on_logging_steps_and_the_last(tmp_path):
    """The VAE's step (two optimizers, manual optimization) follows the same rule: its ~10 loss
    parts on the steps that write logs, with that step's values; train/loss also on the last."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vae_helpers import DDCONFIG, LOSS

    from ldm.autoencoder_training import autoencoder_kl

    torch.manual_seed(0)
    model = autoencoder_kl(ddconfig=DDCONFIG, lossconfig=LOSS, embed_dim=4, learning_rate=1e-4)
    logged_at: dict[str, list[int]] = {}
    log = model.log

    def counted_log(name, value, *args, **kwargs):  # log_dict calls it for each value too
        logged_at.setdefault(name, []).append(model.trainer.global_step)
        return log(name, value, *args, **kwargs)

    model.log = counted_log
    losses = StepLosses()
    losses.on_train_batch_end = lambda trainer, module, outputs, batch, i: losses.losses.update(
        {trainer.global_step: float(outputs["loss"])}
    )
    trainer = quiet_trainer(
        max_steps=6,
        log_every_n_steps=4,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[losses],
        default_root_dir=tmp_path,
    )
    images = [{"image": torch.rand(3, 32, 32) * 2 - 1} for _ in range(12)]
    trainer.fit(model, DataLoader(images, batch_size=2))
    # Optimizer steps counted after the generator's step (1-based here): logs written at 4.
    assert logged_at["train/rec_loss"] == [4]
    assert logged_at["train/disc_loss"] == [4]
    assert logged_at["train/loss"] == [4, 6]  # and the last step, not the one before it
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        written = {
            int(row["step"]): float(row["train/loss"])
            for row in csv.DictReader(file)
            if row.get("train/loss")
        }
    assert written.keys() == {3}  # Lightning's 0-based step of the write at 4
    for step, value in written.items():
        assert abs(value - losses.losses[step + 1]) <= 1e-6 * abs(losses.losses[step + 1])
    assert float(trainer.callback_metrics["train/loss"]) == losses.losses[6]
