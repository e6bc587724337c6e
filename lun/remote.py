"""Run folders on object storage: `-l s3://bucket/runs` and `--resume s3://bucket/runs/<run>`.

Object stores have no rename and no append, so a run is not written there directly. It lives in
a local staging folder (`$LUN_STAGING_DIR`, default `~/.cache/lun/runs/<protocol>/<bucket>/...`)
where everything works as for a local run - atomic checkpoint files, TensorBoard, sample images
- and is mirrored to its URL:

- each checkpoint, right after its atomic local write, is uploaded under a name of its own
  (`checkpoints/<stem>-<sha256[:12]>.ckpt`: never over an object a pointer may name), its size
  checked on the store; only then is the pointer `checkpoints/LATEST` replaced - a small JSON
  object naming the newest complete checkpoint with its step, size and sha256. A kill at any
  moment leaves the previous pointer, naming a whole object; older versions are deleted after.
- every other file (configs, images, TensorBoard events) is copied when it changed: once a
  minute during training, at its end or crash, and when `fit` returns (after the loggers close).
- `--resume URL` reads the pointer, downloads that checkpoint into a staging folder (its size
  and sha256 checked against the pointer) and the saved configs, and resumes from them as from a
  local run folder (`lun.run.resume_target`): bitwise exactly, on any machine.

Upload failures (a network blip) are logged and retried at the next save; the local files stay.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lun.atomic_io import AtomicCheckpointIO
from lun.run import RunDir, checkpoint_step, is_rank_zero, new_run_dir
from lun.storage import StorageError, check_reachable, is_url, join, protocol

log = logging.getLogger(__name__)

POINTER = "checkpoints/LATEST"
SYNC_EVERY_S = 60.0
_VERSIONED = re.compile(r"^(?P<stem>.+)-(?P<sha>[0-9a-f]{12})(?P<suffix>\.[^.]+)$")


def staging_dir() -> Path:
    """$LUN_STAGING_DIR, else $XDG_CACHE_HOME/lun/runs, else ~/.cache/lun/runs."""
    if os.environ.get("LUN_STAGING_DIR"):
        return Path(os.environ["LUN_STAGING_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lun" / "runs"


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class RemoteRun:
    """The mirror of a staging run folder at `url` (rank zero only)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.path = check_reachable(self.url)  # StorageError before anything exists
        self.run_dir = RunDir(staging_dir() / protocol(url) / self.path.lstrip("/"))
        self._mirrored: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) uploaded
        self._pending: set[str] = set()  # checkpoints whose upload failed: retried
        self._last_sync = 0.0

    def _remote(self, rel: str) -> str:
        return join(self.path, rel)

    # -- the pointer -----------------------------------------------------------------------------
    def pointer(self) -> dict | None:
        """The pointer's contents, None before the first complete upload."""
        try:
            return json.loads(self.fs.cat_file(self._remote(POINTER)))
        except FileNotFoundError:
            return None

    # -- checkpoints -----------------------------------------------------------------------------
    def upload_checkpoint(self, local: str | os.PathLike) -> None:
        """Upload a checkpoint file just written in staging, then move the pointer to it if it
        is the newest complete training checkpoint. Failures are logged; retried next time."""
        self._pending.add(os.path.abspath(local))
        for path in sorted(self._pending):
            try:
                self._upload_checkpoint(Path(path))
                self._pending.discard(path)
            except FileNotFoundError:  # rotated away locally since: nothing left to upload
                self._pending.discard(path)
            except Exception as err:  # the SDKs' errors share no base class
                log.warning(f"upload of {path} to {self.url} failed ({err}); retried at next save")

    def _upload_checkpoint(self, local: Path) -> None:
        size, sha = local.stat().st_size, sha256_of(local)
        stem, suffix = os.path.splitext(local.name)
        key = f"checkpoints/{stem}-{sha[:12]}{suffix}"
        remote = self._remote(key)
        self.fs.put_file(str(local), remote)
        self.fs.invalidate_cache(os.path.dirname(remote))
        stored = self.fs.info(remote)["size"]
        if stored != size:  # never point at an object that is not the whole file
            raise OSError(f"{remote} holds {stored} bytes after the upload, the file {size}")
        step = checkpoint_step(local, need_training_state=True)
        current = self.pointer()
        if step is not None and (current is None or step >= current["step"]):
            record = {"checkpoint": key, "name": local.name, "step": step, "size": size}
            self.fs.pipe_file(self._remote(POINTER), json.dumps({**record, "sha256": sha}).encode())
            log.info(f"uploaded {local.name} (step {step}) to {join(self.url, key)}")
        self._remove_versions(local.name, keep=key)

    def _remove_versions(self, name: str, keep: str | None = None) -> None:
        """Delete the store's other versions of checkpoint `name`, never the pointer's."""
        current = self.pointer()
        named = current["checkpoint"] if current else None
        with contextlib.suppress(FileNotFoundError):
            for found in self.fs.ls(self._remote("checkpoints"), detail=False, refresh=True):
                key = f"checkpoints/{found.rsplit('/', 1)[-1]}"
                match = _VERSIONED.match(key.rsplit("/", 1)[-1])
                if match is None or f"{match['stem']}{match['suffix']}" != name:
                    continue
                if key not in (keep, named):
                    self.fs.rm_file(found)

    # -- everything else -------------------------------------------------------------------------
    def sync(self) -> None:
        """Copy the staging files that changed since the last sync (checkpoints have their own
        way up, links and temporaries stay local)."""
        self._last_sync = time.monotonic()
        root = self.run_dir.root
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [s for s in subfolders if not s.startswith(".")]
            for name in names:
                path = Path(folder) / name
                rel = path.relative_to(root).as_posix()
                if rel.startswith("checkpoints/") or name.startswith(".") or path.is_symlink():
                    continue
                stat = path.stat()
                if self._mirrored.get(rel) == (stat.st_size, stat.st_mtime_ns):
                    continue
                try:
                    self.fs.put_file(str(path), self._remote(rel))
                    self._mirrored[rel] = (stat.st_size, stat.st_mtime_ns)
                except Exception as err:
                    log.warning(f"upload of {rel} to {self.url} failed ({err}); retried later")

    def attach(self, trainer) -> None:
        """Make `trainer` upload its checkpoints and mirror the rest (rank zero's part)."""
        trainer.strategy.checkpoint_io = MirroredCheckpointIO(self)
        trainer.callbacks.append(Mirror(self))

    # -- resume ----------------------------------------------------------------------------------
    def fetch_resume(self) -> Path:
        """Download the pointer's checkpoint (verified) and the saved configs into staging;
        returns the local checkpoint."""
        current = self.pointer()
        if current is None:
            raise StorageError(f"--resume {self.url}: no {POINTER}; no checkpoint was uploaded")
        configs = self.fs.glob(self._remote("configs/*.yaml"))
        if not configs:
            raise StorageError(f"--resume {self.url}: no saved configs under configs/")
        self.run_dir.configs.mkdir(parents=True, exist_ok=True)
        for found in configs:
            local = self.run_dir.configs / found.rsplit("/", 1)[-1]
            self.fs.get_file(found, str(local))
            stat = local.stat()
            self._mirrored[f"configs/{local.name}"] = (stat.st_size, stat.st_mtime_ns)
        local = self.run_dir.checkpoints / current["name"]
        if local.is_file() and not local.is_symlink() and sha256_of(local) == current["sha256"]:
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        temporary = local.with_name(f".{local.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.get_file(self._remote(current["checkpoint"]), str(temporary))
            if (
                temporary.stat().st_size != current["size"]
                or sha256_of(temporary) != current["sha256"]
            ):
                raise StorageError(
                    f"--resume {self.url}: {current['checkpoint']} does not match the size and "
                    f"sha256 in {POINTER}"
                )
            os.replace(temporary, local)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
        log.info(f"downloaded {current['checkpoint']} (step {current['step']}) from {self.url}")
        return local


class MirroredCheckpointIO(AtomicCheckpointIO):
    """Atomic local checkpoint writes (staging), each followed by its upload to the store."""

    def __init__(self, remote: RemoteRun):
        super().__init__()
        self.remote = remote

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.remote.upload_checkpoint(path)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        with contextlib.suppress(Exception):  # a leftover version costs space, not correctness
            self.remote._remove_versions(os.path.basename(path))


class Mirror(Callback):
    """Copies the staging folder's changed files up every `SYNC_EVERY_S`, at the end and on a
    crash (checkpoints go up as they are written, by MirroredCheckpointIO)."""

    def __init__(self, remote: RemoteRun):
        self.remote = remote

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if time.monotonic() - self.remote._last_sync > SYNC_EVERY_S:
            self.remote.sync()

    def on_train_end(self, trainer, pl_module) -> None:
        self.remote.sync()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.remote.sync()


# -- the launcher's calls ------------------------------------------------------------------------
def new_run(logdir: str, name: str, postfix: str = "") -> tuple[RunDir, RemoteRun | None]:
    """The run folder for `-l LOGDIR`: local, or a staging folder mirrored to the URL."""
    if not is_url(logdir):
        return new_run_dir(logdir, name, postfix), None
    local = new_run_dir("", name, postfix)  # the timestamped name
    remote = RemoteRun(join(logdir, local.root.name))
    return remote.run_dir, remote if is_rank_zero() else None


def resolve_resume(resume: str) -> tuple[str, RemoteRun | None]:
    """`--resume`'s local run folder or checkpoint: a URL's checkpoint is downloaded first."""
    if not is_url(resume):
        return resume, None
    remote = RemoteRun(resume)
    return str(remote.fetch_resume()), remote if is_rank_zero() else None
