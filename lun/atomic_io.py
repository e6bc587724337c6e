"""Checkpoint files that survive a crash or a full disk: write aside, fsync, then rename.

A checkpoint is only useful if it is whole. Writing straight into `last.ckpt` means a crash, a
preemption or a full disk half-way through leaves a truncated file where the previous good one
was. Here every local write goes to a temporary file in the same folder (so the final rename
never crosses a file system), is flushed and fsync'ed, and only then replaces the target with
`os.replace` - an atomic rename on POSIX and Windows. Either the old file or the complete new one
is there, never a mix. The folder is fsync'ed afterwards so the rename itself is on disk.

Lightning routes every single-file checkpoint write (`Trainer.save_checkpoint`, and so every
`ModelCheckpoint`) through `trainer.strategy.checkpoint_io`, so passing the plugin once covers
them all: `Trainer(plugins=[AtomicCheckpointIO()])`. (DeepSpeed and sharded FSDP checkpoints
are folders written by those libraries and do not pass through a CheckpointIO.)
"""

import contextlib
import glob
import os
import uuid
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol


def _temporary_name(path: str) -> str:
    folder, name = os.path.split(path)
    # Hidden and unique: a crashed writer's leftover never matches `last*.ckpt` patterns.
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_folder(folder: str) -> None:
    """Make a rename in `folder` durable (POSIX); Windows cannot open folders, and needs not."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(path: str, keep: str) -> None:
    """Delete temporaries of `path` left by writers that were killed (they can be gigabytes)."""
    folder, name = os.path.split(path)
    for stale in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.tmp-*")):
        if stale != keep:
            with contextlib.suppress(OSError):
                os.remove(stale)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)` that leaves either the old file or the whole new one.

    The object is streamed into the temporary file (no in-memory copy of a many-GB checkpoint).
    Any failure - an unpicklable object, ENOSPC, an interrupt - removes the temporary file and
    re-raises; the previous `path` is untouched.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    temporary = _temporary_name(path)
    # os.open with 0o666 lets the umask decide permissions, as a plain open() would.
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
    )
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _fsync_folder(folder)
    _remove_stale_temporaries(path, keep=temporary)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO whose local writes are atomic (temp file, fsync, rename).

    Use: `Trainer(plugins=[AtomicCheckpointIO()])`. Loading and removing are Lightning's own.
    Remote paths (`s3://...`) keep Lightning's fsspec transaction, which uploads the object whole.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO does not take `storage_options`; "
                "`Trainer.save_checkpoint(path)` without it writes atomically"
            )
        if not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, path)
