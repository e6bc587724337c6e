"""Load and merge YAML configs; turn every config mistake into one clear line."""

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

logger = logging.getLogger("lun.config")


class ConfigError(ValueError):
    """A mistake in the user's config: the message is one line naming the key or file."""


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


def translate_legacy_keys(cfg: DictConfig) -> DictConfig:
    """Move keys of older configs to where their meaning lives now, one warning line each.

    Applied to the merged config, before `check_complete`; changes `cfg` in place and returns it.
    """
    _move_caption_dropout(cfg)
    return cfg


def _move_caption_dropout(cfg: DictConfig) -> None:
    """`data.params.<split>.params.caption_dropout` -> `model.params.ucg_rate`.

    Caption dropout for classifier-free guidance has one owner, the model's conditioner, so the
    datasets no longer take it. Only the train split's value has a meaning (validation and test
    never drop captions); another split's value is ignored with a warning.
    """
    splits = OmegaConf.select(cfg, "data.params", default=None)
    if not isinstance(splits, DictConfig):
        return
    found = []  # every value is read before any key moves: one may interpolate another
    for split in list(splits.keys()):
        params = OmegaConf.select(splits, f"{split}.params", default=None)
        if not isinstance(params, DictConfig) or "caption_dropout" not in params:
            continue
        if OmegaConf.is_missing(params, "caption_dropout"):
            continue  # left for check_complete, which names the key
        key = f"data.params.{split}.params.caption_dropout"
        found.append((split, params, key, _probability(key, _value(cfg, key))))
    for split, params, key, value in found:
        if split != "train":
            del params["caption_dropout"]
            logger.warning("%s is ignored: only the train split drops captions", key)
            continue
        if "model" not in cfg:
            continue  # the launcher reports the missing section
        target = "model.params.ucg_rate"
        current = _value(cfg, target)  # read first: it may interpolate the key moved here
        if current is not None and current != value:
            raise ConfigError(
                f"{key}={value} and {target}={current} disagree: caption dropout is set only "
                f"by {target} now; remove {key}"
            )
        del params["caption_dropout"]
        if OmegaConf.select(cfg, "model.params", default=None) is None:
            cfg.model.params = {}
        cfg.model.params.ucg_rate = value
        logger.warning(
            "%s is a legacy key: its value %s moved to %s%s",
            key,
            value,
            target,
            "" if current is None else " (which already had it)",
        )


def _value(cfg: DictConfig, key: str):
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve {key}: {_first_line(err)}") from None


def _probability(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"{key}={value}: expected a probability in [0, 1]")
    return float(value)


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


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]
