"""Load and merge YAML configs; turn every config mistake into one clear line."""

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lun.errors import ConfigError
from lun.errors import first_line as _first_line

logger = logging.getLogger("lun.config")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` (no dot) as text; read it as the number it means, as OmegaConf's
    dotlist overrides do, so `base_learning_rate: 1e-4` in a file equals `...=1e-4` on the line."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: str | Path) -> DictConfig:
    """Read one YAML file; a syntax error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader: no Python objects
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


REPLACE = "_replace_"  # `key: {_replace_: true, ...}` replaces the earlier `key` instead of merging


def merge_configs(paths: Sequence[str | Path], dotlist: Sequence[str] = ()) -> DictConfig:
    """Merge YAML files left to right, then `key.path=value` overrides (which win).

    Two ways to replace where merging would mix: a mapping holding `_replace_: true` (in a later
    file, or `key._replace_=true` on the command line) replaces the earlier value of its key
    instead of merging into it, and `~key.path` on the command line deletes that key from the
    merged files before the overrides apply (`~data.params.validation`).
    """
    configs = [load_yaml(p) for p in paths]
    deletions = [item[1:] for item in dotlist if item.startswith("~")]
    overrides = [item for item in dotlist if not item.startswith("~")]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key.path=value")
    try:
        merged = OmegaConf.create()
        for config in configs:
            merged = _merge_replacing(merged, config)
        for key in deletions:
            _delete(merged, key)
        return _merge_replacing(merged, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot merge configs: {_first_line(err)}") from None


def _merge_replacing(merged: DictConfig, config: DictConfig) -> DictConfig:
    """`config` merged onto `merged`, each key whose mapping is marked `_replace_: true` first
    deleted from `merged` (the marker itself is dropped)."""
    plain = OmegaConf.to_container(config, resolve=False)  # `${...}` and `???` kept as written
    for path in list(_replacements(plain)):
        parent = merged
        for name in path[:-1]:
            parent = parent._get_node(name) if isinstance(parent, DictConfig) else None
        if isinstance(parent, DictConfig) and path[-1] in parent:
            del parent[path[-1]]
    return OmegaConf.merge(merged, OmegaConf.create(plain))


def _replacements(node, path: tuple = ()) -> Iterator[tuple]:
    """Paths of the mappings in `node` marked `_replace_: true`, outermost first; the markers
    are removed from `node`."""
    if not isinstance(node, dict):
        return
    if REPLACE in node:
        marker = node.pop(REPLACE)
        if not isinstance(marker, bool):
            where = ".".join(map(str, (*path, REPLACE)))
            raise ConfigError(f"{where}={marker!r}: expected true or false")
        if marker and path:
            yield path
    for key, value in node.items():
        yield from _replacements(value, (*path, key))


def _delete(cfg: DictConfig, key: str) -> None:
    """`~key.path`: delete the key, which must exist."""
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
    if not name or not isinstance(parent, DictConfig) or name not in parent:
        raise ConfigError(f"~{key}: no such key in the merged configs to delete")
    del parent[name]


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


@contextmanager
def config_errors(key: str, config: Mapping | None = None) -> Iterator[None]:
    """Inside, a ValueError - a constructor refusing a value, an unknown target or parameter - is
    a ConfigError naming `key`, the config section being built from `config`.

    Constructors name the parameter first (`flip_p=2: expected ...`, `metadata_params.x: ...`):
    when that name is a key found exactly once under `config`, the message gets its full path
    (`data.params.train.params.flip_p=2: ...`). Anything else (TypeError, AttributeError, ...) is
    a bug, not a config mistake, and keeps its traceback.
    """
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        message = _first_line(err)
        name = re.match(r"(\w+)[=.:]", message)
        paths = list(_key_paths(config, name.group(1))) if name and config else []
        if len(paths) == 1:
            raise ConfigError(f"{key}.{paths[0]}{message[len(name.group(1)) :]}") from err
        raise ConfigError(f"{key}: {message}") from err


def _key_paths(node, name: str, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every key called `name` in nested mappings and lists."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == name:
                yield f"{prefix}{key}"
            yield from _key_paths(value, name, f"{prefix}{key}.")
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _key_paths(value, name, f"{prefix}{i}.")


def to_container(cfg: DictConfig) -> dict:
    """A plain dict with interpolations resolved (what the objects are built from)."""
    return OmegaConf.to_container(cfg, resolve=True)


# The Lightning-1 / launcher translations moved to lun.legacy; their old import path still works.
_LEGACY_NAMES = {"translate_legacy_keys", "legacy_resume", "set_data_root", "translate_gpus"}


def __getattr__(name: str):
    if name in _LEGACY_NAMES:
        from lun import legacy

        return getattr(legacy, name)
    raise AttributeError(f"module 'lun.config' has no attribute {name!r}")


def config_nodes(model_config):
    """(dotted key, dict) of every mapping in the model config, depth first in file order."""
    stack = [("model", model_config)]
    while stack:
        key, node = stack.pop()
        if isinstance(node, list):
            stack += [(f"{key}.{i}", v) for i, v in reversed(list(enumerate(node)))]
            continue
        if not isinstance(node, dict):
            continue
        stack += [(f"{key}.{k}", v) for k, v in reversed(list(node.items())) if k != "target"]
        yield key, node
