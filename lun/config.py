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


def translate_legacy_keys(cfg: DictConfig) -> DictConfig:
    """Move keys of older configs to where their meaning lives now, one warning line each.

    Applied to the merged config, before `check_complete`; changes `cfg` in place and returns it.
    `lightning.trainer.resume_from_checkpoint` is left for `legacy_resume`.
    """
    _move_caption_dropout(cfg)
    _translate_data_module(cfg)
    _translate_open_diffusion_keys(cfg)
    _translate_trainer_keys(cfg)
    _move_modelcheckpoint(cfg)
    return cfg


def _move_modelcheckpoint(cfg: DictConfig) -> None:
    """The CompVis launcher's `lightning.modelcheckpoint` section configures its default
    checkpoint callback: here that is `lightning.callbacks.modelcheckpoint` (whose own settings
    win where both set a key)."""
    lightning = cfg.get("lightning") if isinstance(cfg, DictConfig) else None
    if not isinstance(lightning, DictConfig) or "modelcheckpoint" not in lightning:
        return
    legacy = lightning.pop("modelcheckpoint")
    if legacy is None:
        return
    if not isinstance(legacy, DictConfig):
        raise ConfigError("lightning.modelcheckpoint: expected a mapping like {params: {...}}")
    callbacks = lightning.get("callbacks") or OmegaConf.create({})
    current = callbacks.get("modelcheckpoint") or OmegaConf.create({})
    callbacks["modelcheckpoint"] = OmegaConf.merge(legacy, current)
    lightning["callbacks"] = callbacks
    logger.warning(
        "lightning.modelcheckpoint is a legacy key: now lightning.callbacks.modelcheckpoint "
        "(the default checkpoint callback)"
    )


# The CompVis launcher's `main.DataModuleFromConfig` params that lun.data.DataModule does without.
DATA_MODULE_NO_EFFECT = {
    "wrap": "datasets are used as they are (no WrappedDataset is needed)",
    "use_worker_init_fn": "workers are always seeded per batch (lun.rng.seeded)",
    "shuffle_test_loader": "the test split is never shuffled",
    "shuffle_val_dataloader": "the validation split is never shuffled",
    "predict": "there is no predict loop; generate with scripts/txt2img.py",
}
# Lightning 1.x Trainer arguments that Lightning 2 removed, with nothing to translate to.
TRAINER_NO_EFFECT = {
    "amp_backend": "mixed precision is torch.autocast, chosen by lightning.trainer.precision",
    "amp_level": "mixed precision is torch.autocast, chosen by lightning.trainer.precision",
    "weights_summary": "use lightning.trainer.enable_model_summary",
    "progress_bar_refresh_rate": "the progress bar is a callback",
    "flush_logs_every_n_steps": "loggers flush on their own (e.g. TensorBoard's flush_secs)",
    "auto_select_gpus": "devices are taken as given",
    "replace_sampler_ddp": "lun.data splits batches across ranks itself",
}
# Lightning 1.x took a strategy as `accelerator: ddp` (the CompVis launcher sets it so).
LEGACY_ACCELERATOR_STRATEGIES = ("ddp", "ddp_spawn", "ddp2", "dp", "ddp_sharded", "deepspeed")


def _translate_data_module(cfg: DictConfig) -> None:
    data = cfg.get("data") if isinstance(cfg, DictConfig) else None
    if not isinstance(data, DictConfig):
        return
    params = data.get("params")
    if data.get("target") == "main.DataModuleFromConfig":
        data.target = "lun.data.DataModule"
        logger.warning(
            "data.target main.DataModuleFromConfig is a legacy target: now lun.data.DataModule"
        )
        # There `num_workers: null` meant twice the batch size; here the default is 0.
        if isinstance(params, DictConfig) and "num_workers" in params:
            if params._get_node("num_workers")._is_none():
                batch_size = _value(cfg, "data.params.batch_size") if "batch_size" in params else 0
                params.num_workers = 2 * batch_size
                logger.warning(
                    "data.params.num_workers: null meant 2 x batch_size there: now %s",
                    params.num_workers,
                )
    elif data.get("target") != "lun.data.DataModule":
        return
    # CompVis' own keys, also in configs that already name lun.data.DataModule.
    if isinstance(params, DictConfig):
        for key, why in DATA_MODULE_NO_EFFECT.items():
            if key in params:
                del params[key]
                logger.warning("data.params.%s has no effect here and is ignored: %s", key, why)


# open-diffusion's dataset params (its `dataset.params`: data/base.py's WebDataset,
# ClassificationWebDataset and ParquetDataset) -> ours: (the dataset's parameter, or the split's
# loader setting when the name starts with "split.").
OPEN_DIFFUSION_KEYS = {
    "lun.data.webdataset.WebDataset": {
        "path": "urls",
        "resolution": "size",
        "class_mapping": "idx_to_prompt",
        "workers": "split.num_workers",
        "batch_size": "split.batch_size",
    },
    "lun.data.webdataset.Parquet": {
        "path": "paths",
        "resolution": "size",
        "workers": "split.num_workers",
        "batch_size": "split.batch_size",
    },
}


def _translate_open_diffusion_keys(cfg: DictConfig) -> None:
    """open-diffusion's keys in a stream's params move to ours, one notice line per split; a
    key given both ways is refused (which one was meant is not ours to guess)."""
    splits = OmegaConf.select(cfg, "data.params", default=None)
    if not isinstance(splits, DictConfig):
        return
    for split in ("train", "validation", "test"):
        node = splits.get(split)
        if not isinstance(node, DictConfig):
            continue
        keys = OPEN_DIFFUSION_KEYS.get(node.get("target"))
        params = node.get("params")
        if keys is None or not isinstance(params, DictConfig):
            continue
        moved = []
        for theirs, ours in keys.items():
            if theirs not in params:
                continue
            where, name = (node, ours[6:]) if ours.startswith("split.") else (params, ours)
            path = f"data.params.{split}.{'' if where is node else 'params.'}{name}"
            if name in where:
                raise ConfigError(
                    f"data.params.{split}.params.{theirs} (open-diffusion's name) and {path} "
                    f"are both set: keep {path}"
                )
            where[name] = params._get_node(theirs)._value()  # interpolations kept as written
            del params[theirs]
            moved.append(f"{theirs} -> {path}")
        if moved:
            logger.warning(
                "data.params.%s.params: open-diffusion's keys mapped: %s", split, ", ".join(moved)
            )


def _translate_trainer_keys(cfg: DictConfig) -> None:
    trainer = OmegaConf.select(cfg, "lightning.trainer", default=None)
    if not isinstance(trainer, DictConfig):
        return
    for key, why in TRAINER_NO_EFFECT.items():
        if key in trainer:
            del trainer[key]
            logger.warning("lightning.trainer.%s has no effect here and is ignored: %s", key, why)
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in LEGACY_ACCELERATOR_STRATEGIES:
        strategy = OmegaConf.select(cfg, "lightning.strategy", default=None)
        if trainer.get("strategy") is None and strategy is None:
            trainer.strategy = accelerator
        del trainer["accelerator"]
        logger.warning(
            "lightning.trainer.accelerator=%s is a Lightning 1.x strategy: now "
            "lightning.trainer.strategy=%s%s",
            accelerator,
            accelerator,
            "" if trainer.get("strategy") == accelerator else " (the strategy set there wins)",
        )
    if "gpus" in trainer:
        translate_gpus(trainer, _value(cfg, "lightning.trainer.gpus"), "lightning.trainer.gpus")
        del trainer["gpus"]


def translate_gpus(trainer: DictConfig, gpus, name: str, wins: bool = False) -> None:
    """Lightning 1.x `gpus` (`--gpus 0,` / `gpus: 2` / `[0, 1]` / `-1` / `0` or null for CPU) ->
    `accelerator` and `devices` in `trainer` (the `lightning.trainer` section), one notice line.
    From the command line (`wins`) it replaces what the files set; in a file it must agree."""
    devices = _gpu_devices(gpus, name)
    if devices is None:
        values = {"accelerator": "cpu"}
    else:
        values = {"accelerator": "gpu", "devices": devices}
    for key, value in values.items():
        current = trainer.get(key)
        if wins or current is None or str(current).lower() in ("auto", str(value).lower()):
            pass
        else:
            raise ConfigError(
                f"{name}={gpus} and lightning.trainer.{key}={current} disagree: "
                f"give lightning.trainer.accelerator and devices only"
            )
        trainer[key] = value
    now = ", ".join(f"lightning.trainer.{k}={v}" for k, v in values.items())
    given = f"{name} {gpus}" if name.startswith("--") else f"{name}={gpus}"
    logger.warning(
        "%s is a legacy %s: now %s", given, "option" if name.startswith("--") else "key", now
    )


def _gpu_devices(gpus, name: str):
    """None for CPU, else what `devices` takes: a count, -1 (all), or a list of indices."""
    if (
        gpus is None
        or gpus == ""
        or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus == 0)
    ):
        return None
    if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= -1:
        return gpus
    if isinstance(gpus, str):
        text = gpus.strip()
        try:
            if "," in text:  # "0," / "0,1": device indices
                return [int(i) for i in text.split(",") if i.strip()] or None
            return _gpu_devices(int(text), name)
        except ValueError:
            pass
    elif isinstance(gpus, Sequence) and all(isinstance(i, int) and i >= 0 for i in gpus):
        return list(gpus) or None
    raise ConfigError(
        f"{name}={gpus!r}: expected a GPU count (-1 for all, 0 for CPU) or indices like '0,' or '0,1'"
    )


def set_data_root(cfg: DictConfig, data_root: str) -> None:
    """`--data_root DIR` (translunar-diffusion's launcher): the data folder of the train split,
    and of the validation split where there is one."""
    keys = []
    for split in ("train", "validation"):
        params = OmegaConf.select(cfg, f"data.params.{split}", default=None)
        if not isinstance(params, DictConfig):
            continue
        if params.get("params") is None:
            params.params = {}
        params.params.data_root = data_root
        keys.append(f"data.params.{split}.params.data_root")
    if not keys:
        raise ConfigError("--data_root: the merged config has no data.params.train to set it in")
    logger.warning("--data_root %s is a legacy option: now %s", data_root, " and ".join(keys))


def legacy_resume(cfg: DictConfig) -> str | None:
    """Remove `lightning.trainer.resume_from_checkpoint` (Lightning 1.x) and return its path,
    which the launcher takes as `--resume`."""
    trainer = OmegaConf.select(cfg, "lightning.trainer", default=None)
    if not isinstance(trainer, DictConfig) or "resume_from_checkpoint" not in trainer:
        return None
    path = _value(cfg, "lightning.trainer.resume_from_checkpoint")
    del trainer["resume_from_checkpoint"]
    if path is None or path == "":
        return None
    logger.warning(
        "lightning.trainer.resume_from_checkpoint=%s is a legacy key: now --resume %s", path, path
    )
    return str(path)


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
