"""Checkpoint files that survive a crash or a full disk: write aside, fsync, then rename.

A checkpoint is only useful if it is whole. Writing straight into `last.ckpt` means a crash, a
preemption or a full disk half-way through leaves a truncated file where the previous good one
was. Here every local write goes to a temporary file in the same folder (so the final rename
never crosses a file system), is flushed and fsync'ed, and only then replaces the target with
`os.replace` - an atomic rename on POSIX and Windows. Either the old file or the complete new one
is there, never a mix. The folder is fsync'ed afterwards so the rename itself is on disk.
`last.ckpt` links are swapped the same way (`atomic_link`), and the start of a run removes what
killed writers left behind (`remove_stale_temporaries`).

Lightning routes every single-file checkpoint write (`Trainer.save_checkpoint`, and so every
`ModelCheckpoint`) through `trainer.strategy.checkpoint_io`, so passing the plugin once covers
them all: `Trainer(plugins=[AtomicCheckpointIO()])`. (DeepSpeed and sharded FSDP checkpoints
are folders written by those libraries and do not pass through a CheckpointIO.)
"""

import contextlib
import glob
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from ldm.checkpoint import temporary_path

# `.NAME.tmp-PID-HEX` (files and links written here) or `.NAME.tmp-HEX` (the folders of
# `lun.strategies`, written by every rank): a writer's work in progress, never a checkpoint.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?:(?P<pid>\d+)-)?[0-9a-f]{8}")
# A temporary without a writer PID is stale once nothing in it changed for this long.
STALE_AFTER_S = 3600.0


def _temporary_name(path: str) -> str:
    # Hidden and unique (`ldm.checkpoint.temporary_path`, the one owner of the name): a crashed
    # writer's leftover never matches `last*.ckpt` patterns, and its PID tells a killed writer's
    # leftover from a file that another live process is still writing.
    return str(temporary_path(Path(path)))


def _fsync_folder(folder: str) -> None:
    """Make a rename in `folder` durable (POSIX); Windows cannot open folders, and needs not."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or no such probe (Windows): keep its file
        return True
    return True


def _newest_change(path: str) -> float:
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest


def is_stale_temporary(path: str | os.PathLike) -> bool:
    """Whether `path` is a temporary of ours that no live writer will finish: the writer's PID in
    its name is gone, or - for a name without one - nothing in it changed for `STALE_AFTER_S`."""
    match = _TEMPORARY.fullmatch(os.path.basename(path))
    if match is None:
        return False
    try:
        if match["pid"] is not None:
            return not _process_alive(int(match["pid"]))
        return time.time() - _newest_change(os.fspath(path)) > STALE_AFTER_S
    except OSError:  # removed meanwhile
        return False


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete what killed writers left in `folder` (it can be gigabytes); returns those paths.

    Only our own temporary names (`.NAME.tmp-*`), and never one whose writer is still alive."""
    found = sorted(Path(folder).glob(".*.tmp-*")) if os.path.isdir(folder) else []
    stale = [path for path in found if is_stale_temporary(path)]
    for path in stale:
        _remove(str(path))
    return stale


def _remove_stale_temporaries(path: str, keep: str) -> None:
    """Delete stale temporaries of `path` (other names' wait for the next start of a run)."""
    folder, name = os.path.split(path)
    for stale in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.tmp-*")):
        if stale != keep and is_stale_temporary(stale):
            _remove(stale)


def atomic_link(target: str | os.PathLike, link: str | os.PathLike) -> None:
    """Make `link` a relative symbolic link to `target`, replacing what was there by one rename.

    The link is made under a temporary name and renamed over `link`, so `link` is at every moment
    the old file or link or the new one - never missing (removing `link` first leaves a run with
    no `last.ckpt` if the process dies in between). Where links cannot be made (Windows without
    the privilege) `link` becomes a copy, written aside and renamed the same way.
    """
    target, link = os.path.abspath(os.fspath(target)), os.path.abspath(os.fspath(link))
    folder = os.path.dirname(link)
    temporary = _temporary_name(link)
    try:
        try:
            os.symlink(os.path.relpath(target, folder), temporary)
        except OSError:
            if os.path.isdir(target):
                shutil.copytree(target, temporary)
            else:
                shutil.copyfile(target, temporary)
        if os.path.isdir(link) and not os.path.islink(link):
            # A folder (DeepSpeed, sharded FSDP) cannot be renamed over: it goes aside first.
            aside = _temporary_name(link)
            os.rename(link, aside)
            os.replace(temporary, link)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(temporary, link)
    except BaseException:
        _remove(temporary)
        raise
    _fsync_folder(folder)


@contextmanager
def _atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file written under a temporary name and renamed over `path` when the block ends:
    readers see the old file or the whole new one. Any failure - ENOSPC, an interrupt - removes
    the temporary file and re-raises; the previous `path` is untouched."""
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
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _fsync_folder(folder)
    _remove_stale_temporaries(path, keep=temporary)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)` that leaves either the old file or the whole new one.

    The object is streamed into the temporary file (no in-memory copy of a many-GB checkpoint).
    Any failure - an unpicklable object, ENOSPC, an interrupt - removes the temporary file and
    re-raises; the previous `path` is untouched.
    """
    with _atomic_file(path) as file:
        torch.save(obj, file)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO whose local writes are atomic (temp file, fsync, rename).

    Use: `Trainer(plugins=[AtomicCheckpointIO()])`. A local file loads after a check of its
    pickle (ldm.safe_load's allow-list), its weights lazily (`lazy_load_checkpoint`); removing
    is Lightning's own. Writing streams the tensors that exist into the file: no copies.
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

    def load_checkpoint(self, path, *args: Any, weights_only: bool | None = None, **kwargs: Any):
        # Resuming from a file: its pickle is checked against the allow-list of ldm.safe_load
        # first, unless the caller trusts it (`Trainer.fit(weights_only=False)`).
        if weights_only is not False and _is_local_file_protocol(path) and os.path.isfile(path):
            from ldm.safe_load import check_pickle

            check_pickle(path)
        if not _is_local_file_protocol(path) or not os.path.isfile(path):
            return super().load_checkpoint(path, *args, weights_only=weights_only, **kwargs)
        return lazy_load_checkpoint(path)


def lazy_load_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint file whose module weights stay in the file until they are used.

    Lightning loads a whole checkpoint into memory before it copies the weights into the model:
    a second full copy of the weights (and the EMA) beside the ones training holds. Here each
    `state_dict` entry is read when it is copied into its parameter (`load_state_dict`) or EMA
    buffer, and freed right after (Lightning's lazy loader), so a resume needs one tensor of
    memory beyond what training holds. Everything else - the optimizer state, which becomes the
    optimizer's own tensors, and the loops' and callbacks' state - is read now. The pickle must
    have been checked before (`ldm.safe_load.check_pickle`): this loader trusts the file.
    """
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    checkpoint = _lazy_load(path)
    weights = checkpoint.pop("state_dict", None)
    checkpoint = _materialize_tensors(checkpoint)
    if weights is not None:
        checkpoint["state_dict"] = weights
    return checkpoint


def materialized(value):
    """A tensor of a `lazy_load_checkpoint` read into memory (other values as they are)."""
    from lightning.fabric.utilities.load import _materialize_tensors

    return _materialize_tensors(value)
