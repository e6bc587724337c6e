"""Fixtures of the callback tests: the model, data and a CPU Trainer (see callback_testing.py)."""

import lightning.pytorch as pl
import pytest
import torch
from callback_testing import RandomImages, TinyDiffusion
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lun.atomic_io import AtomicCheckpointIO
from lun.callbacks.progress import SmoothedProgressBar


@pytest.fixture
def make_module():
    def make():
        torch.manual_seed(0)
        return TinyDiffusion()

    return make


@pytest.fixture
def make_loader():
    def make(batches: int = 4, batch_size: int = 2, nan_batches=(), same: bool = False):
        nan_items = [b * batch_size + i for b in nan_batches for i in range(batch_size)]
        dataset = RandomImages(batches * batch_size, nan_items, same)
        return DataLoader(dataset, batch_size=batch_size, shuffle=False)

    return make


@pytest.fixture
def fit(tmp_path):
    """fit(module, callbacks, train_loader, val_loader=None, ckpt_path=None, **Trainer kwargs) -> Trainer."""

    def run(module, callbacks, train_loader, val_loader=None, ckpt_path=None, **kwargs):
        options = dict(
            accelerator="cpu",
            devices=1,
            max_steps=4,
            logger=False,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=any(isinstance(c, SmoothedProgressBar) for c in callbacks),
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(tmp_path),
            plugins=[AtomicCheckpointIO()],
            limit_val_batches=1 if val_loader is not None else 0,
        )
        options.update(kwargs)
        trainer = pl.Trainer(callbacks=callbacks, **options)
        trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt_path)
        return trainer

    return run
