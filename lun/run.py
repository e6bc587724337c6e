"""The run folder: where a run writes, how a resumed run finds its checkpoint and configs."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lun.config import ConfigError


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
        for folder in (self.checkpoints, self.configs, self.images):
            folder.mkdir(parents=True, exist_ok=True)

    def save_configs(self, cfg: DictConfig) -> None:
        """Write the merged config as `<ts>-project.yaml` (model, data) and `<ts>-lightning.yaml`."""
        # A resumed run adds a newer pair; on the next resume the newest wins the merge.
        timestamp = time.strftime("%Y-%m-%dT%H-%M-%S")
        project = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "lightning"])
        OmegaConf.save(project, self.configs / f"{timestamp}-project.yaml")
        lightning = OmegaConf.create({"lightning": cfg.get("lightning", {})})
        OmegaConf.save(lightning, self.configs / f"{timestamp}-lightning.yaml")


def new_run_dir(logdir: str, name: str, postfix: str = "") -> RunDir:
    timestamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    return RunDir(Path(logdir) / f"{timestamp}_{name}{postfix}")


def resume_target(resume: str) -> tuple[RunDir, Path]:
    """`--resume` takes a run folder (its checkpoints/last.ckpt) or a .ckpt inside one: a file, or
    the folder DeepSpeed and sharded FSDP write."""
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"--resume: '{resume}' does not exist")
    if path.is_file() or path.suffix == ".ckpt":
        ckpt = path
        root = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    else:
        root = path
        ckpt = path / "checkpoints" / "last.ckpt"
        if not ckpt.exists():
            raise ConfigError(f"--resume: no checkpoints/last.ckpt in run folder '{resume}'")
    return RunDir(root), ckpt


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
