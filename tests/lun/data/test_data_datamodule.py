"""lun.data.DataModule: built from config as the launcher does, seeded workers, exact resume."""

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import OmegaConf

from ldm.model_contract import TrainingContract
from ldm.util import instantiate_from_config


def _config(root, **params):
    return OmegaConf.create(
        {
            "target": "lun.data.DataModule",
            "params": {
                "batch_size": 2,
                "num_workers": 0,
                "train": {
                    "target": "lun.data.local.Local",
                    "params": {"data_root": str(root), "size": 16, "cache_dir": False},
                },
                **params,
            },
        }
    )


def test_built_from_config_yields_the_batch_contract(flat_folder):
    datamodule = instantiate_from_config(_config(flat_folder, num_workers=2))
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    assert loader.persistent_workers  # default with workers
    batches = list(loader)
    assert len(batches) == 3
    for batch in batches:
        assert batch["image"].dtype == torch.float32 and batch["image"].shape == (2, 3, 16, 16)
        assert batch["image"].min() >= -1 and batch["image"].max() <= 1
        assert isinstance(batch["caption"], list) and all(
            isinstance(c, str) for c in batch["caption"]
        )
    # No validation configured: no hook, so Lightning runs no validation loop.
    assert not is_overridden("val_dataloader", datamodule)
    assert not is_overridden("test_dataloader", datamodule)


def test_per_split_overrides_and_unknown_keys(flat_folder):
    validation = {
        "target": "lun.data.local.Local",
        "params": {"data_root": str(flat_folder), "size": 8, "cache_dir": False},
        "batch_size": 4,
        "num_workers": 0,
    }
    test = {**validation, "batch_size": 6}
    datamodule = instantiate_from_config(_config(flat_folder, validation=validation, test=test))
    datamodule.setup("fit")
    assert is_overridden("val_dataloader", datamodule)
    sizes = [len(b["caption"]) for b in datamodule.val_dataloader()]
    assert sizes == [4, 2]  # fixed order, every item once
    assert len(datamodule.train_dataloader()) == 3
    assert [b["image"].shape for b in datamodule.test_dataloader()] == [(6, 3, 8, 8)]
    bad = instantiate_from_config(_config(flat_folder, validation={**validation, "batchsize": 4}))
    bad.setup("fit")
    with pytest.raises(ValueError, match="unknown key.*batchsize"):
        bad.val_dataloader()


def test_bucketed_batches_hold_one_bucket(tmp_path, writers):
    for i, size in enumerate([(64, 32)] * 4 + [(32, 64)] * 4 + [(40, 40)] * 2):
        writers.save(tmp_path / "images" / f"{i}.png", size=size)
    config = _config(tmp_path)
    config.params.train.params.buckets = {"step": 8}
    config.params.train.params.size = 32
    datamodule = instantiate_from_config(config)
    datamodule.setup("fit")
    shapes = [tuple(b["image"].shape) for b in datamodule.train_dataloader()]
    assert sorted(shapes) == [(2, 3, 24, 40)] * 2 + [(2, 3, 32, 32)] + [(2, 3, 40, 24)] * 2


def test_ddp_without_disabling_lightnings_sampler_injection_is_a_clear_error(flat_folder):
    datamodule = instantiate_from_config(_config(flat_folder))
    datamodule.trainer = SimpleNamespace(
        world_size=2,
        global_rank=1,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=True),
    )
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        datamodule.train_dataloader()
    datamodule.trainer._accelerator_connector.use_distributed_sampler = False
    assert len(datamodule.train_dataloader()) == 2  # 6 items, 3 batches, split over 2 ranks


class Recorder(TrainingContract, L.LightningModule):
    """Records the captions of every training batch."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(tuple(batch["caption"]))
        return self.weight * batch["image"].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(datamodule_config, ckpt_dir, ckpt_path=None, max_epochs=2, **trainer_args):
    L.seed_everything(7)
    model = Recorder()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
        default_root_dir=ckpt_dir,
        **trainer_args,
    )
    trainer.fit(model, datamodule=instantiate_from_config(datamodule_config), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_resume_continues_mid_epoch_exactly(tmp_path, flat_folder, writers):
    for i in range(6, 10):  # 10 items, batch 3: 4 batches per epoch with a topped-up last batch
        writers.save(flat_folder / "images" / f"{i}.png")
        (flat_folder / "images" / f"{i}.txt").write_text(f"caption {i}")
    config = _config(flat_folder, batch_size=3)
    full = _fit(config, tmp_path / "full")
    assert len(full) == 8 and full[:4] != full[4:]  # epochs are shuffled differently
    for step in (3, 4, 6):  # mid-epoch, at the epoch's end, and in the second epoch
        resumed = _fit(
            config, tmp_path / f"resumed{step}", ckpt_path=tmp_path / "full" / f"step={step}.ckpt"
        )
        assert resumed == full[step:], step
    checkpoint = torch.load(tmp_path / "full" / "step=3.ckpt", weights_only=False)
    assert checkpoint["DataModule"]["train"] | {"seed": None} == {
        "epoch": 0,
        "position": 3,
        "world_size": 1,
        "num_batches": 4,
        "seed": None,
    }


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_resume_after_a_limited_epoch_starts_the_next_epoch(tmp_path, flat_folder):
    config = _config(flat_folder)
    full = _fit(config, tmp_path / "full", limit_train_batches=2)
    assert len(full) == 4
    resumed = _fit(
        config,
        tmp_path / "resumed",
        ckpt_path=tmp_path / "full" / "step=2.ckpt",
        limit_train_batches=2,
    )
    assert resumed == full[2:]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_webdataset_resume_with_two_workers_continues_exactly(tmp_path, writers):
    for s in range(2):
        samples = [
            (f"{s}{i}", {"jpg": writers.jpeg_bytes(seed=i), "txt": f"s{s}-{i}"}) for i in range(6)
        ]
        writers.shard(tmp_path / f"{s}.tar", samples)
    train = {
        "target": "lun.data.webdataset.WebDataset",
        "params": {
            "urls": str(tmp_path / "{0..1}.tar"),
            "num_examples_to_see": 10,
            "size": 8,
            "shuffle_buffer": 4,
        },
    }
    config = OmegaConf.create(
        {
            "target": "lun.data.DataModule",
            "params": {"batch_size": 2, "num_workers": 2, "train": train},
        }
    )
    full = _fit(config, tmp_path / "full")
    assert len(full) == 10
    assert (
        _fit(config, tmp_path / "resumed", ckpt_path=tmp_path / "full" / "step=3.ckpt") == full[3:]
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unreadable_images_are_summarised_at_epoch_boundaries(flat_folder, caplog, num_workers):
    (flat_folder / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    datamodule = instantiate_from_config(
        _config(flat_folder, batch_size=7, num_workers=num_workers)
    )
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        for _ in range(2):
            assert [len(b["caption"]) for b in loader] == [7]
        datamodule.teardown("fit")
    # Workers flag failures in shared memory, so the main process counts them too.
    assert int(datamodule.datasets["train"].bad_input.failed.sum()) == 1
    messages = [r.getMessage() for r in caplog.records]
    if num_workers == 0:  # (worker processes log through their own handlers)
        assert sum(m.startswith("unreadable ") and "broken.png" in m for m in messages) == 1
    assert any("after epoch 0, 1 of 7 items were unreadable" in m for m in messages)
    assert any("at the end, 1 of 7 items were unreadable" in m for m in messages)


def test_seed_and_pin_memory_settings(flat_folder):
    orders = []
    for seed in (1, 1, 2):
        datamodule = instantiate_from_config(_config(flat_folder, seed=seed, pin_memory=True))
        loader = datamodule.train_dataloader()
        assert loader.pin_memory and not loader.persistent_workers
        orders.append(list(loader.batch_sampler))
    assert orders[0] == orders[1] != orders[2]


def test_pinned_batches_by_default_on_cuda_only(flat_folder):
    datamodule = instantiate_from_config(_config(flat_folder))
    assert not datamodule.train_dataloader().pin_memory  # no trainer: nothing to pin for
    for device, pinned in (("cuda", True), ("xpu", True), ("cpu", False), ("mps", False)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
        datamodule = instantiate_from_config(_config(flat_folder))
        datamodule.trainer = trainer
        assert datamodule._settings("train")["pin_memory"] is pinned
    datamodule = instantiate_from_config(_config(flat_folder, pin_memory=False))
    datamodule.trainer = trainer
    assert datamodule._settings("train")["pin_memory"] is False  # the user's word wins


def test_epoch_boundaries_keep_the_same_workers(flat_folder):
    """A small set (a DreamBooth set) crosses an epoch every few steps: its workers must live
    on, not be started again at every boundary."""
    import os

    from torch.utils.data import get_worker_info

    from lun.data.local import Local

    seen = []

    class WorkerPid(Local):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            return {**item, "pid": torch.tensor(os.getpid() if get_worker_info() else -1)}

    config = _config(flat_folder, num_workers=1)
    config.params.train.target = f"{__name__}.WorkerPidLocal"
    globals()["WorkerPidLocal"] = WorkerPid
    loader = instantiate_from_config(config).train_dataloader()
    for _ in range(3):  # three epochs
        seen += [int(pid) for batch in loader for pid in batch["pid"]]
    assert loader.persistent_workers
    assert len(set(seen)) == 1 and seen[0] not in (-1, os.getpid()), set(seen)
