"""A small set (a 20-image DreamBooth set) ends an epoch every few steps: through a real
Lightning fit, its loader workers must be the same processes in every epoch (persistent), not
started again at each boundary (issue 30, item 3)."""

import os

import lightning.pytorch as pl
import torch
from conftest import save_image
from omegaconf import OmegaConf
from torch.utils.data import get_worker_info

from ldm.util import instantiate_from_config
from lun.data.local import Local


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
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=4,  # 4 epochs of 5 steps: 3 boundaries
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 20 and sorted(model.pids) == [0, 1, 2, 3]
    first = model.pids[0]
    assert len(first) == 2 and not first & {-1, os.getpid()}, first  # two worker processes
    for epoch, pids in model.pids.items():
        assert pids == first, (epoch, pids, first)  # the same two, every epoch
