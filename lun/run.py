"""The run folder: where a run writes, how a resumed run finds its checkpoint and configs; and
the SIGUSR1 a run may get before its trainer exists.

Light on purpose (no torch, no Lightning): the launcher imports it first thing.
"""

import logging
import os
import pickle
import re
import signal
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, ListConfig, OmegaConf

from lun.config import ConfigError

if TYPE_CHECKING:
    from lun.contract import TrainableModule

log = logging.getLogger(__name__)


@dataclass
class RunDir:
    """`logs/<YYYY-mm-ddTHH-MM-SS>_<name><postfix>/` and its parts."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    @property
    def images(self) -> Path:
        return self.root / "images"

    def create(self) -> None:
        """Make the folders; on a resume, delete what killed checkpoint writers left behind."""
        from lun.atomic_io import remove_stale_temporaries  # imports torch: not at start-up

        for folder in (self.checkpoints, self.configs, self.images):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temporaries(self.checkpoints):
            log.info(f"removed {stale}, left by a checkpoint write that was killed")

    def save_configs(self, cfg: DictConfig) -> None:
        """Write the merged config as `<ts>-project.yaml` (model, data) and `<ts>-lightning.yaml`,
        as written: a resume re-reads them, and an interpolation such as
        `total_steps: ${lightning.trainer.max_steps}` follows a new `max_steps`.

        The project file also works alone (`txt2img.py --config`, `--base` of a new run): the
        values its interpolations take from other sections (`lightning.trainer.max_steps`) are
        kept in it, as this run had them (`referenced_values`)."""
        # A resumed run adds a newer pair; on the next resume the newest wins the merge.
        timestamp = time.strftime("%Y-%m-%dT%H-%M-%S")
        sections = [k for k in cfg if k != "lightning"]
        project = OmegaConf.masked_copy(cfg, sections)
        referenced = referenced_values(cfg, sections)
        if referenced:
            project = OmegaConf.merge(project, referenced)
        OmegaConf.save(project, self.configs / f"{timestamp}-project.yaml")
        lightning = OmegaConf.create({"lightning": cfg.get("lightning", {})})
        OmegaConf.save(lightning, self.configs / f"{timestamp}-lightning.yaml")


# `${a.b.c}`: an absolute node interpolation (relative ones start with a dot, resolvers hold `:`).
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)\}")


def referenced_values(cfg: DictConfig, sections: list[str]) -> DictConfig:
    """The values that interpolations in `sections` take from outside them, resolved, as a
    config of their own: `{lightning: {trainer: {max_steps: 6}}}`."""
    found = OmegaConf.create()

    def walk(node) -> None:
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            for key in _INTERPOLATION.findall(node):
                if key.split(".")[0] not in sections:
                    value = OmegaConf.select(cfg, key, throw_on_missing=False)
                    if isinstance(value, DictConfig | ListConfig):
                        value = OmegaConf.to_container(value, resolve=True)
                    OmegaConf.update(found, key, value, force_add=True)

    walk(OmegaConf.to_container(OmegaConf.masked_copy(cfg, sections), resolve=False))
    return found


def new_run_dir(logdir: str, name: str, postfix: str = "") -> RunDir:
    """`LOGDIR/<time>_<name><postfix>`, refused in one line (before anything is made) when the
    name would be a path (`-n a/b` made the folder `<time>_a` with a run in `b`) or `logdir`
    (or a folder above it) is a file."""
    folder = f"{time.strftime('%Y-%m-%dT%H-%M-%S')}_{name}{postfix}"
    if Path(folder).name != folder:
        raise ConfigError(
            f"-n/--name, --postfix: '{name}{postfix}' holds a '/'; a run's name is one folder "
            "name (its parent folder is -l/--logdir)"
        )
    existing = next((p for p in (Path(logdir), *Path(logdir).parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(
            f"-l/--logdir: '{existing}' is a file; give a folder for the run folders (it is "
            "made if missing)"
        )
    return RunDir(Path(logdir) / folder)


def resume_target(
    resume: str, verb: str = "resuming from", check: Callable[[Path], None] | None = None
) -> tuple[RunDir, Path]:
    """`--resume` takes a run folder or a checkpoint inside one (a file, or the folder DeepSpeed
    and sharded FSDP write). From a run folder it takes the newest complete checkpoint in
    `checkpoints/` (highest step; the newest file on a tie), which is `on_exception.ckpt` after a
    crash or Ctrl-C later than the last periodic save, and still found if `last.ckpt` is not.
    `verb` says what the launcher does with it ("validating" for --validate-only); `check`
    refuses the file (code in its pickles) before it is named as the one resumed."""
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"--resume: '{resume}' does not exist")
    if path.is_file() or path.suffix == ".ckpt":
        ckpt = path
        root = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        step = checkpoint_step(ckpt)
        found = f"step {step}" if step is not None else "step unknown"
    else:
        root = path
        ckpt, step = newest_checkpoint(path / "checkpoints")
        found = f"step {step}, the newest complete checkpoint of the run"
    if check is not None:
        check(ckpt)
    if is_rank_zero():
        log.info(f"{verb} {ckpt} ({found})")
    return RunDir(root), ckpt


def newest_checkpoint(folder: Path) -> tuple[Path, int]:
    """(path, step) of the complete checkpoint in `folder` with the highest global step, the
    newest file on a tie. Links (`last.ckpt`) are skipped: they name another file there.
    Incomplete files and weights-only ones (nothing to resume) are skipped with a note."""
    complete = []
    for candidate in sorted(folder.glob("*.ckpt")) if folder.is_dir() else []:
        if candidate.name.startswith(".") or candidate.is_symlink():
            continue
        step = checkpoint_step(candidate, need_training_state=True)
        if step is None:
            if is_rank_zero():
                log.warning(f"--resume: skipped {candidate}: not a complete training checkpoint")
            continue
        complete.append((step, candidate.stat().st_mtime, candidate.name, candidate))
    if not complete:
        runs = sorted(folder.parent.glob("*/checkpoints"), key=lambda p: p.stat().st_mtime)
        hint = f"; it holds runs: resume one, e.g. {runs[-1].parent}" if runs else ""
        raise ConfigError(f"--resume: no complete checkpoint in '{folder}'{hint}")
    step, _, _, newest = max(complete)
    return newest, step


class _Inert:
    """Stands in for every class a checkpoint's pickle names: nothing is imported or run."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _StepReader(pickle.Unpickler):
    """Reads the plain values of a torch checkpoint's `data.pkl`, never its tensors (they stay on
    disk: persistent ids) nor any class (each becomes `_Inert`): cheap and safe on any file."""

    def find_class(self, module, name):
        return _Inert

    def persistent_load(self, pid):
        return None


def _step_file(folder: Path) -> Path | None:
    """The file of a checkpoint folder that holds its global step: DeepSpeed's rank-0
    `*model_states.pt` (under the tag `latest` names), Lightning's sharded FSDP `meta.pt`."""
    latest = folder / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "*"
    found = sorted(folder.glob(f"{tag}/*model_states.pt")) or sorted(folder.glob("meta.pt"))
    return found[0] if found else None


def _plain_values(path: Path) -> dict | None:
    """A checkpoint's plain values (global step, loop progress, ...) read without loading its
    tensors; None when it is not a complete torch checkpoint."""
    file = _step_file(path) if path.is_dir() else path
    if file is None:
        return None
    try:
        with zipfile.ZipFile(file) as archive:  # a truncated file has no central directory
            pickled = [
                n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1
            ]
            if not pickled:
                return None
            with archive.open(pickled[0]) as data:
                contents = _StepReader(data).load()
    except Exception:  # unreadable, truncated, not a torch zip file: not a usable checkpoint
        return None
    if not isinstance(contents, dict) or not isinstance(contents.get("global_step"), int):
        return None
    return contents


def checkpoint_step(path: Path, need_training_state: bool = False) -> int | None:
    """The global step a checkpoint was saved at, read without loading its tensors; None when it
    is not a complete torch checkpoint (or, with `need_training_state`, a file without optimizer
    state: `save_weights_only`)."""
    contents = _plain_values(path)
    if contents is None:
        return None
    if need_training_state and path.is_file() and "optimizer_states" not in contents:
        return None
    return contents["global_step"]


def _epochs_done(contents: dict) -> int | None:
    """Epochs a checkpoint's fit loop counts as done: the `processed` count its `done` compares
    with max_epochs (Lightning's fit_loop.py: `completed` lags it in the epoch-end save)."""
    try:
        return int(contents["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return None


def nothing_left_problem(checkpoint: Path, max_steps: int, max_epochs: int | None) -> str | None:
    """One line when the checkpoint to resume has reached `max_steps` or `max_epochs` already:
    Lightning would load it and stop at once, having trained nothing, without a word."""
    contents = _plain_values(checkpoint)
    if contents is None:
        return None
    step, epochs = contents["global_step"], _epochs_done(contents)
    if max_steps >= 0 and step >= max_steps:
        return (
            f"lightning.trainer.max_steps: {max_steps}, but {checkpoint} is at step {step}: "
            f"nothing is left to train; resume with lightning.trainer.max_steps=N for an N "
            f"above {step}"
        )
    if max_epochs is not None and max_epochs >= 0 and epochs is not None and epochs >= max_epochs:
        return (
            f"lightning.trainer.max_epochs: {max_epochs}, but {checkpoint} has trained {epochs} "
            f"epoch(s): nothing is left to train; resume with lightning.trainer.max_epochs=N for "
            f"an N above {epochs}"
        )
    return None


def saved_configs(run: RunDir) -> list[Path]:
    """The configs a run saved, oldest first (a resumed run re-reads them unless --base is given)."""
    found = sorted(run.configs.glob("*.yaml"))
    if not found:
        raise ConfigError(f"--resume: no saved configs in '{run.configs}'; pass --base")
    return found


def is_rank_zero() -> bool:
    """Rank from the launcher's environment (torchrun, SLURM, Lightning), before any process group."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        if os.environ.get(var, "0") != "0":
            return False
    return True


# SIGUSR1 (SLURM's warning before preemption) kills a process that has no handler for it. The
# launcher holds it from its first line; the checkpoint callback takes over when fit starts and
# saves after the first step if one came meanwhile (lun.callbacks.signals).
_held_signals: list[int] = []


def hold_save_signal() -> None:
    """Remember SIGUSR1 from now on instead of dying of it (call before anything slow)."""
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _held_signals.append(signum))


def take_held_save_signal() -> bool:
    """Whether SIGUSR1 came since `hold_save_signal` (and forget it)."""
    held = bool(_held_signals)
    _held_signals.clear()
    return held


def check_strategy_fits(model: "TrainableModule", strategy, resuming: bool = False) -> None:
    """Before the run folder: a strategy the module cannot train under (the module says which:
    `strategy_problem`) - its error would come from inside `fit`, after the folder exists. The
    module is told what the strategy does with its parameters (`strategy_casts_parameters`: a
    plain value, as ldm cannot ask lun.strategies)."""
    from lun.strategies import casts_parameters, find_unused_parameters, strategy_kind

    model.strategy_casts_parameters = casts_parameters(strategy)

    problem = model.strategy_problem(
        strategy_kind(strategy),
        find_unused_parameters=find_unused_parameters(strategy),
        resuming=resuming,
    )
    if problem:
        raise ConfigError(problem)
