"""Build the run's parts from the merged config: the data (its datasets indexed and probed), the
Lightning Trainer from the `lightning:` section, and the model.

Everything here runs before the launcher creates the run folder, so a bad value is one config
error line (lun.config.config_errors) and never a traceback inside `fit` beside a fresh
checkpoint: values Lightning or the data loaders would only check when training starts are
checked here first.
"""

import difflib
import inspect
import typing
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

from ldm.util import get_obj_from_str, instantiate_from_config
from lun.callbacks.defaults import default_callback_configs
from lun.callbacks.signals import SignalCheckpoint
from lun.config import ConfigError, config_errors
from lun.data.datamodule import LOADER_KEYS, DataModule
from lun.run import RunDir

TRAINER_PARAMETERS = dict(inspect.signature(Trainer.__init__).parameters)
TRAINER_ARGS = set(TRAINER_PARAMETERS) - {"self"}
# Built here from other sections; setting them in `lightning.trainer` would be ambiguous.
BUILT_HERE = {"callbacks", "logger", "plugins", "default_root_dir"}
# Counts Lightning checks only once `fit` runs (or first compares with `<`): the lowest value
# allowed, and what -1 means where it is allowed. null is allowed where Trainer's type says so.
TRAINER_COUNTS = {
    "max_steps": (-1, "no limit"),
    "max_epochs": (-1, "no limit"),
    "min_steps": (0, ""),
    "min_epochs": (0, ""),
    "accumulate_grad_batches": (1, ""),
    "num_nodes": (1, ""),
    "check_val_every_n_epoch": (1, ""),
    "num_sanity_val_steps": (-1, "all batches"),
    "log_every_n_steps": (0, ""),
    "reload_dataloaders_every_n_epochs": (0, ""),
}
# The DataModule's loader settings, checked before any loader exists: key -> (test, allowed).
LOADER_VALUES = {
    "batch_size": (lambda v: _is_count(v, 1), "a whole number >= 1"),
    "num_workers": (lambda v: _is_count(v, 0), "a whole number >= 0"),
    "persistent_workers": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "pin_memory": (lambda v: isinstance(v, bool), "true or false"),
}
# split -> the setup stage that builds it; "fit" also builds validation, so it comes last.
SPLITS = {"validation": "validate", "test": "test", "train": "fit"}


def _is_count(value, lowest: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lowest


def check_target(key: str, config: dict, base: type) -> None:
    """`<key>.target` must name a `base` subclass (or a function that builds one), not a module or
    a value: `model.target: ldm.util` is a config error, not "'module' object is not callable"."""
    with config_errors(key):
        obj = get_obj_from_str(config["target"]) if "target" in config else None
    if obj is None:
        raise ConfigError(f"{key}.target: missing; expected the path of a {base.__name__} class")
    if isinstance(obj, type):
        if issubclass(obj, base):
            return
        what = f"the class {obj.__name__}"
    elif inspect.ismodule(obj):
        what = "a module"
    elif callable(obj):
        return  # a function that builds one: what it built is checked then
    else:
        what = f"a {type(obj).__name__}"
    raise ConfigError(
        f"{key}.target: '{config['target']}' is {what}; expected a {base.__name__} class"
    )


def _built(key: str, config: dict, obj, base: type):
    if not isinstance(obj, base):
        raise ConfigError(
            f"{key}.target: '{config['target']}' built a {type(obj).__name__}; "
            f"expected a {base.__name__}"
        )
    return obj


def build_model(config: dict) -> LightningModule:
    """`model` -> the LightningModule; a value its constructors refuse is a config error."""
    check_target("model", config, LightningModule)
    with config_errors("model", config):
        return _built("model", config, instantiate_from_config(config), LightningModule)


def build_data(config: dict) -> LightningDataModule:
    """`data` -> the DataModule. A lun.data.DataModule's loader settings are checked and its
    datasets built now (indexing, and a first image decoded where the dataset can
    `check_readable`), so a missing folder or a dataset without one usable image is a config
    error naming its key; Lightning's `setup` then finds them built."""
    check_target("data", config, LightningDataModule)
    with config_errors("data", config):
        data = _built("data", config, instantiate_from_config(config), LightningDataModule)
    if not isinstance(data, DataModule):
        return data
    params = config.get("params") or {}
    _check_loader_values("data.params", params)
    for split, stage in SPLITS.items():
        if params.get(split) is None:
            continue
        key = f"data.params.{split}"
        _check_loader_values(key, params[split], split=True)
        with config_errors(key, params[split]):
            data.setup(stage)
            check_readable = getattr(data.datasets[split], "check_readable", None)
            if check_readable is not None:
                check_readable()
    return data


def _check_loader_values(key: str, settings: dict, split: bool = False) -> None:
    if split:
        unknown = sorted(set(settings) - {"target", "params", *LOADER_KEYS})
        if unknown:
            near = difflib.get_close_matches(unknown[0], LOADER_KEYS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(
                f"{key}.{unknown[0]}: not a loader setting ({', '.join(LOADER_KEYS)}){hint}"
            )
    for name, (valid, allowed) in LOADER_VALUES.items():
        if name in settings and not valid(settings[name]):
            raise ConfigError(f"{key}.{name}={settings[name]!r}: expected {allowed}")


def _check_trainer_values(kwargs: dict) -> None:
    for name, (lowest, minus_one) in TRAINER_COUNTS.items():
        if name not in kwargs:
            continue
        value = kwargs[name]
        nullable = type(None) in typing.get_args(TRAINER_PARAMETERS[name].annotation)
        if (value is None and nullable) or _is_count(value, lowest):
            continue
        allowed = [f"a whole number >= {max(lowest, 0)}"]
        allowed += [f"-1 for {minus_one}"] * bool(minus_one) + ["null"] * nullable
        allowed = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
        raise ConfigError(f"lightning.trainer.{name}={value!r}: expected {allowed}")
    _check_accelerator(kwargs.get("accelerator"))


def _check_accelerator(name) -> None:
    """An accelerator this machine lacks, named before Lightning's "No supported gpu backend"."""
    if not isinstance(name, str) or name.lower() == "auto":
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry

    known = AcceleratorRegistry.available_accelerators()
    wanted = ("cuda", "mps") if name.lower() == "gpu" else (name.lower(),)
    if not all(n in known for n in wanted):
        return  # an unknown name: Lightning's own error lists the choices
    if not any(AcceleratorRegistry[n]["accelerator"].is_available() for n in wanted):
        available = sorted(n for n in known if AcceleratorRegistry[n]["accelerator"].is_available())
        raise ConfigError(
            f"lightning.trainer.accelerator={name!r}: not available on this machine; "
            f"expected auto or one of {', '.join(available)}"
        )


def trainer_kwargs(lightning_cfg: dict) -> dict[str, Any]:
    """`lightning.trainer` checked against `Trainer`'s signature, with `accelerator: auto`."""
    kwargs = dict(lightning_cfg.get("trainer") or {})
    for key in kwargs:
        if key in BUILT_HERE:
            raise ConfigError(f"lightning.trainer.{key}: set it in the 'lightning.{key}' section")
        if key not in TRAINER_ARGS:
            near = difflib.get_close_matches(key, TRAINER_ARGS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"lightning.trainer.{key}: not a Trainer argument{hint}")
    _check_trainer_values(kwargs)
    kwargs.setdefault("accelerator", "auto")
    # lun.data's samplers split batches across ranks themselves (and resume mid-epoch).
    kwargs.setdefault("use_distributed_sampler", False)
    # `lightning.strategy` (the presets' place) wins over `lightning.trainer.strategy`.
    strategy = lightning_cfg.get("strategy") or kwargs.get("strategy")
    if strategy:
        kwargs["strategy"] = _build_strategy(strategy)
    return kwargs


def _build_strategy(strategy_cfg):
    """`lightning.strategy` is a name ('ddp') or a `{target, params}` mapping; DeepSpeed and FSDP
    become the adapters of `lun.strategies` (which also run on CPU)."""
    from lun.strategies import build_strategy

    try:
        with config_errors("lightning.strategy", strategy_cfg):
            return build_strategy(strategy_cfg)
    except ImportError as err:  # e.g. DeepSpeed asked for and not installed
        raise ConfigError(f"lightning.strategy: {err}") from None


def build_callbacks(lightning_cfg: dict, run: RunDir, has_validation: bool, use_ema: bool) -> list:
    """Default callbacks merged with `lightning.callbacks` (same name overrides, null removes)."""
    configs = default_callback_configs(str(run.root), has_validation, use_ema=use_ema)
    if lightning_cfg.get("logger") is False:
        configs.pop("learning_rate_logger")  # it has nowhere to log
    for name, cfg in (lightning_cfg.get("callbacks") or {}).items():
        if cfg is None:
            configs.pop(name, None)
        elif "target" in cfg and cfg["target"] != configs.get(name, {}).get("target"):
            configs[name] = cfg  # another class: its own params only
        else:  # a partial override (e.g. only `params.every_n_train_steps`) keeps the rest
            configs[name] = OmegaConf.to_container(OmegaConf.merge(configs.get(name, {}), cfg))
    callbacks = []
    for name, cfg in configs.items():
        with config_errors(f"lightning.callbacks.{name}", cfg):
            callbacks.append(instantiate_from_config(cfg))
    # Always on: crashes and Ctrl-C leave a checkpoint; SIGUSR1 saves and goes on.
    callbacks.append(SignalCheckpoint(dirpath=str(run.checkpoints)))
    return callbacks


def build_logger(lightning_cfg: dict, run: RunDir):
    """TensorBoard under the run folder unless `lightning.logger` names another (or is false)."""
    logger_cfg = lightning_cfg.get("logger")
    if logger_cfg is False:
        return False
    if logger_cfg:
        params = {"save_dir": str(run.root), **(logger_cfg.get("params") or {})}
        with config_errors("lightning.logger", logger_cfg):
            return instantiate_from_config({"target": logger_cfg["target"], "params": params})
    return TensorBoardLogger(save_dir=str(run.root), name="tensorboard", version="")


def build_trainer(
    lightning_cfg: dict, run: RunDir, has_validation: bool, use_ema: bool = False
) -> Trainer:
    from lun.atomic_io import AtomicCheckpointIO

    kwargs = trainer_kwargs(lightning_cfg)
    callbacks = build_callbacks(lightning_cfg, run, has_validation, use_ema)
    logger = build_logger(lightning_cfg, run)
    try:
        return Trainer(
            **kwargs,
            callbacks=callbacks,
            logger=logger,
            plugins=[AtomicCheckpointIO()],
            default_root_dir=str(run.root),
        )
    except (ValueError, TypeError, MisconfigurationException) as err:
        # Lightning's own validation (unknown accelerator, bad precision, ...) is a config error.
        raise ConfigError(f"lightning.trainer: {str(err).splitlines()[0]}") from None
