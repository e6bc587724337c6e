"""A small set (a 20-image DreamBooth set) ends an epoch every few steps: through a real
Lightning fit, its loader workers must be the same processes in every epoch (persistent), not
started again at each boundary, and they must already load the next epoch's first batches while
this epoch's last ones train (no wait at the boundary; issue 30, item 3)."""

import os
import time

import lightning.pytorch as pl
import torch
from conftest import save_image
from omegaconf import OmegaConf
from torch.utils.data import get_worker_info

from ldm.util import instantiate_from_config
from lun.data import DataModule
from lun.data.local import Local
from trainer_helpers import quiet_trainer


class PidLocal(Local):
    """Each sample says which process loaded it."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return {**item, "pid": torch.tensor(os.getpid() if get_worker_info() else -1)}


class PidRecorder(pl.LightningModule):
    """A one-weight model that notes, per epoch, the processes that loaded its batches."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.pids: dict[int, set[int]] = {}

    def training_step(self, batch, batch_idx):
        self.pids.setdefault(self.current_epoch, set()).update(batch["pid"].tolist())
        return (self.weight - batch["image"].mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def own_sampler_trainer(tmp_path, **trainer_args) -> pl.Trainer:
    """A quiet CPU Trainer with the DataModule's own sampler (as main.py runs it)."""
    return quiet_trainer(use_distributed_sampler=False, default_root_dir=tmp_path, **trainer_args)


def test_a_twenty_image_set_keeps_its_workers_across_epochs(tmp_path):
    for i in range(20):
        save_image(tmp_path / "set" / f"{i}.png", size=(16, 16), color=(12 * i, 40, 90))
        (tmp_path / "set" / f"{i}.txt").write_text(f"a photo of sks {i}")
    config = OmegaConf.create(
        {
            "target": "lun.data.DataModule",
            "params": {
                "batch_size": 4,
                "num_workers": 2,
                "train": {
                    "target": f"{__name__}.PidLocal",
                    "params": {"data_root": str(tmp_path / "set"), "size": 16, "cache_dir": False},
                },
            },
        }
    )
    data, model = instantiate_from_config(config), PidRecorder()
    trainer = own_sampler_trainer(tmp_path, max_epochs=4)  # 4 epochs of 5 steps: 3 boundaries
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 20 and sorted(model.pids) == [0, 1, 2, 3]
    first = model.pids[0]
    assert len(first) == 2 and not first & {-1, os.getpid()}, first  # two worker processes
    for epoch, pids in model.pids.items():
        assert pids == first, (epoch, pids, first)  # the same two, every epoch


class LoggedItems(torch.utils.data.Dataset):
    """20 tiny items; every request (in whichever process) appends the item's index to `log`."""

    def __init__(self, log: str):
        self.log = log

    def __len__(self):
        return 20

    def __getitem__(self, index):
        with open(self.log, "a") as file:  # one short append: whole lines from any process
            file.write(f"{index}\n")
        return {"image": torch.zeros(1), "caption": str(index)}


def requests(log) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


class EpochRecorder(pl.LightningModule):
    """Notes each epoch's items and, when epoch 0 ends, how many items had been requested."""

    def __init__(self, log, workers: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.log_path, self.workers, self.items, self.requested_in_epoch_0 = log, workers, {}, None

    def training_step(self, batch, batch_idx):
        self.items.setdefault(self.current_epoch, []).extend(batch["caption"])
        return (self.weight - batch["image"].mean()) ** 2

    def on_train_epoch_end(self):
        if self.current_epoch == 0 and self.requested_in_epoch_0 is None:
            # Lightning makes epoch 1's iterator after this hook: an item requested by now was
            # read ahead. Workers run on their own time, so wait for them (bounded).
            deadline = time.monotonic() + (20 if self.workers else 0)
            while requests(self.log_path) <= 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.requested_in_epoch_0 = requests(self.log_path)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def epoch_items(tmp_path, name: str, num_workers: int, **trainer_args):
    log = tmp_path / f"{name}.log"
    train = {"target": f"{__name__}.LoggedItems", "params": {"log": str(log)}}
    data = DataModule(train, batch_size=4, num_workers=num_workers, seed=3)
    model = EpochRecorder(log, workers=num_workers > 0)
    trainer = own_sampler_trainer(tmp_path, **trainer_args)
    trainer.fit(model, datamodule=data)
    return model


def test_the_workers_load_the_next_epoch_before_this_one_ends_in_the_same_order(tmp_path):
    ahead = epoch_items(tmp_path, "ahead", num_workers=2, max_epochs=3)
    # 20 items, batch 4: epoch 0 requests items 0-19 once; more means epoch 1's were on the way.
    assert ahead.requested_in_epoch_0 > 20, ahead.requested_in_epoch_0
    # The order is the sampler's, epoch by epoch: the same as loading in-process, one epoch at
    # a time (no reading ahead there), which is also what a resume replays.
    in_process = epoch_items(tmp_path, "in_process", num_workers=0, max_epochs=3)
    assert in_process.requested_in_epoch_0 == 20
    assert ahead.items == in_process.items
    assert all(sorted(map(int, items)) == list(range(20)) for items in ahead.items.values())


def test_an_epoch_cut_short_does_not_leak_its_rest_into_the_next(tmp_path):
    # limit_train_batches ends each epoch after 2 of its 5 batches: the batches read ahead from
    # the rest of the epoch must be dropped, and the next epoch start at its own first batch.
    cut = dict(max_epochs=3, limit_train_batches=2)
    ahead = epoch_items(tmp_path, "ahead", num_workers=2, **cut)
    in_process = epoch_items(tmp_path, "in_process", num_workers=0, **cut)
    assert ahead.items == in_process.items and len(ahead.items[2]) == 8
