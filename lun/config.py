"""Load and merge YAML configs; turn every config mistake into one clear line."""

from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A mistake in the user's config: the message is one line naming the key or file."""


def load_yaml(path: str | Path) -> DictConfig:
    """Read one YAML file; a syntax error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"YAML syntax error at {where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return OmegaConf.create(data)


def merge_configs(paths: Sequence[str | Path], dotlist: Sequence[str] = ()) -> DictConfig:
    """Merge YAML files left to right, then `key.path=value` overrides (which win)."""
    configs = [load_yaml(p) for p in paths]
    for item in dotlist:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key.path=value")
    try:
        configs.append(OmegaConf.from_dotlist(list(dotlist)))
        return OmegaConf.merge(*configs) if configs else OmegaConf.create()
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot merge configs: {_first_line(err)}") from None


def check_complete(cfg: DictConfig) -> None:
    """Fail on the first required value (`???`) left unset, and on broken interpolations."""
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if not missing:
            OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve config: {_first_line(err)}") from None
    if missing:
        more = (
            f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else ""
        )
        raise ConfigError(
            f"missing required value '{missing[0]}': set it in a YAML file or as "
            f"{missing[0]}=...{more}"
        )


def to_container(cfg: DictConfig) -> dict:
    """A plain dict with interpolations resolved (what the objects are built from)."""
    return OmegaConf.to_container(cfg, resolve=True)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]
