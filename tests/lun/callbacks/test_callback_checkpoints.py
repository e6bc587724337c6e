import builtins
import errno
import io
import os

import lightning.pytorch as pl
import pytest
import torch
from callback_testing import trainable_weights
from lightning.pytorch.loggers import TensorBoardLogger

from ldm.util import instantiate_from_config
from lun import atomic_io
from lun.atomic_io import AtomicCheckpointIO, atomic_torch_save
from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.defaults import default_callback_configs
from lun.run import RunDir
from lun.trainer import build_trainer


def load(path):
    return torch.load(path, weights_only=True)


def test_default_set_names_and_opt_ins(tmp_path):
    run = str(tmp_path / "run")
    with_val = default_callback_configs(run, has_validation=True)
    assert {
        "progress_bar",
        "modelcheckpoint",
        "metrics_over_trainsteps_checkpoint",
        "best_checkpoint",
        "learning_rate_logger",
        "epoch_stats",
        "rng_state",
        "nan_guard",
        "throughput",
    } == set(with_val)
    assert "best_checkpoint" not in default_callback_configs(run, has_validation=False)
    assert "ema" in default_callback_configs(run, has_validation=False, use_ema=True)
    callbacks = {name: instantiate_from_config(config) for name, config in with_val.items()}
    assert callbacks["modelcheckpoint"].filename == "every-2k-steps"
    assert callbacks["metrics_over_trainsteps_checkpoint"].filename == "step-{step:09d}"
    assert callbacks["best_checkpoint"].filename == "best"
    assert callbacks["best_checkpoint"].dirpath == os.path.realpath(
        os.path.join(run, "checkpoints")
    )
    assert len({c.state_key for c in callbacks.values()}) == len(callbacks)


def test_default_set_writes_the_promised_files(make_module, make_loader, tmp_path):
    run = tmp_path / "run"
    configs = default_callback_configs(str(run), has_validation=True)
    configs["modelcheckpoint"]["params"]["every_n_train_steps"] = 2
    configs["metrics_over_trainsteps_checkpoint"]["params"]["every_n_train_steps"] = 3
    configs["progress_bar"]["params"]["interactive"] = False
    by_name = {name: instantiate_from_config(c) for name, c in configs.items()}
    callbacks = list(by_name.values())
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=7,
        val_check_interval=2,
        limit_val_batches=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        logger=TensorBoardLogger(str(run), name="tb"),
        enable_model_summary=False,
    )
    trainer.fit(make_module(), make_loader(batches=8), make_loader(batches=1))

    folder = run / "checkpoints"
    assert sorted(os.listdir(folder)) == [
        "best.ckpt",
        "every-2-steps.ckpt",
        "last.ckpt",
        "step-000000003.ckpt",
        "step-000000006.ckpt",
    ]
    assert os.path.islink(folder / "last.ckpt")  # no second write of the same state
    assert load(folder / "last.ckpt")["global_step"] == 7  # saved when training ended
    assert load(folder / "step-000000003.ckpt")["global_step"] == 3
    assert load(folder / "best.ckpt")["global_step"] in (2, 4, 6)
    lrs = by_name["learning_rate_logger"].lrs
    assert len(lrs) == 1 and set(next(iter(lrs.values()))) == {
        trainer.optimizers[0].param_groups[0]["lr"]
    }


def test_save_every_n_samples_counts_images_at_optimizer_steps(
    make_module, make_loader, fit, tmp_path
):
    saver = Checkpoint(dirpath=str(tmp_path), save_every_n_samples=5, save_top_k=-1)
    # 2 images per batch, 2 batches per optimizer step: 4, 8, 12 images after steps 1, 2, 3.
    fit(make_module(), [saver], make_loader(batches=6), max_steps=3, accumulate_grad_batches=2)
    assert sorted(os.listdir(tmp_path)) == [
        "samples-000000000008.ckpt",
        "samples-000000000012.ckpt",
    ]
    checkpoint = load(tmp_path / "samples-000000000012.ckpt")
    assert checkpoint["global_step"] == 3
    assert checkpoint["callbacks"][saver.state_key]["samples_seen"] == 12


def test_save_every_n_samples_is_an_alternative_not_an_addition():
    with pytest.raises(ValueError, match="every_n_train_steps"):
        Checkpoint(save_every_n_samples=100, every_n_train_steps=10)
    assert Checkpoint(save_every_n_samples=2_000_000).filename == "every-2M-samples"


def half_write_then_full_disk(fail_when):
    """A torch.save that, when `fail_when(obj)`, writes half the bytes and then hits a full disk."""
    real_save = torch.save

    def save(obj, file):
        if not fail_when(obj):
            return real_save(obj, file)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    return save


def test_a_write_failing_half_way_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    writer = AtomicCheckpointIO()
    writer.save_checkpoint({"weights": torch.arange(4.0)}, path)
    monkeypatch.setattr(atomic_io.torch, "save", half_write_then_full_disk(lambda obj: True))
    with pytest.raises(OSError, match="No space left"):
        writer.save_checkpoint({"weights": torch.zeros(100_000)}, path)
    assert torch.equal(load(path)["weights"], torch.arange(4.0))
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary left behind


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    stale = tmp_path / ".last.ckpt.tmp-999-deadbeef"
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / ".other.ckpt.tmp-999-deadbeef"
    other.write_bytes(b"another file's")
    atomic_torch_save({"a": 1}, tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == [".other.ckpt.tmp-999-deadbeef", "last.ckpt"]


def test_new_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    atomic_torch_save({"a": 1}, tmp_path / "x.ckpt")
    assert os.stat(tmp_path / "x.ckpt").st_mode & 0o777 == 0o666 & ~umask


def test_trainer_checkpoints_go_through_the_atomic_writer(
    make_module, make_loader, fit, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        atomic_io.torch, "save", half_write_then_full_disk(lambda obj: obj["global_step"] == 4)
    )
    weights = {}

    class Remember(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            weights[trainer.global_step] = trainable_weights(pl_module)

    saver = Checkpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    with pytest.raises(OSError, match="No space left"):
        fit(make_module(), [Remember(), saver], make_loader(), max_steps=6)
    # The save at step 4 failed half-way: the file still holds step 2, whole.
    assert os.listdir(tmp_path / "ckpt") == ["every-2-steps.ckpt"]
    checkpoint = load(tmp_path / "ckpt" / "every-2-steps.ckpt")
    assert checkpoint["global_step"] == 2
    assert all(
        torch.equal(checkpoint["state_dict"]["model." + n], w) for n, w in weights[2].items()
    )


def checkpoint_folder_on_its_own_disk(monkeypatch, folder, full_from_step: int):
    """The file-system faults of a run folder on a disk of its own (logs on a data or shared disk,
    $TMPDIR elsewhere, e.g. on tmpfs), a disk that fills up during the save of `full_from_step`.

    - A rename into `folder` from another folder fails with EXDEV, as the kernel does across
      file systems (so a writer must stage its temporary file in the checkpoint's own folder).
    - Once full, every write onto that disk fails with ENOSPC: `torch.save` into a file writes
      half the bytes first; opening a file of `folder` for writing truncates it (as `open(.., "wb")`
      does) before the first write fails. Memory and the other disk still have room.
    """
    folder = os.path.realpath(folder)
    full = False
    real_save, real_open = torch.save, builtins.open

    def folder_of(path) -> str:
        return os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))

    def in_folder(path) -> bool:
        return isinstance(path, str | os.PathLike) and folder_of(path) == folder

    def no_space():
        return OSError(errno.ENOSPC, "No space left on device")

    def save(obj, file, *args, **kwargs):
        nonlocal full
        full = full or (isinstance(obj, dict) and obj.get("global_step") == full_from_step)
        if not full or isinstance(file, io.BytesIO):
            return real_save(obj, file, *args, **kwargs)
        if in_folder(file):
            file = real_open(file, "wb")
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        raise no_space()

    def open_(file, mode="r", *args, **kwargs):
        if full and in_folder(file) and any(c in mode for c in "wax+"):
            real_open(file, "wb").close()
            raise no_space()
        return real_open(file, mode, *args, **kwargs)

    def rename_with(real):
        def rename(src, dst, *args, **kwargs):
            if in_folder(dst) and not in_folder(src):
                raise OSError(errno.EXDEV, "Invalid cross-device link", os.fspath(src))
            return real(src, dst, *args, **kwargs)

        return rename

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "rename", rename_with(os.rename))
    monkeypatch.setattr(os, "replace", rename_with(os.replace))


def test_the_launchers_trainer_never_leaves_a_partial_checkpoint(
    make_module, make_loader, tmp_path, monkeypatch
):
    """Through `lun.trainer.build_trainer` (what main.py runs) and its own checkpoint_io: a save
    that fails half-way leaves the previous complete checkpoint of that name, and no partial file
    under any checkpoint name - also when the temporary folder is on another disk."""
    run = RunDir(tmp_path / "run")
    run.create()
    lightning_cfg = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 6,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "num_sanity_val_steps": 0,
        },
        "logger": False,
        "callbacks": {
            "progress_bar": None,
            "metrics_over_trainsteps_checkpoint": None,
            "modelcheckpoint": {"params": {"every_n_train_steps": 2}},
        },
    }
    trainer = build_trainer(lightning_cfg, run, has_validation=False)
    weights = {}

    class Remember(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            weights[trainer.global_step] = trainable_weights(pl_module)

    trainer.callbacks.insert(0, Remember())
    checkpoint_folder_on_its_own_disk(monkeypatch, run.checkpoints, full_from_step=4)
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(make_module(), make_loader())
    monkeypatch.undo()

    # The save at step 4 (and the crash checkpoint after it) failed: what is left is step 2, whole.
    assert sorted(os.listdir(run.checkpoints)) == ["every-2-steps.ckpt", "last.ckpt"]
    for name in ("every-2-steps.ckpt", "last.ckpt"):
        checkpoint = load(run.checkpoints / name)
        assert checkpoint["global_step"] == 2
        assert all(
            torch.equal(checkpoint["state_dict"]["model." + n], w) for n, w in weights[2].items()
        )
