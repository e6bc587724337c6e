"""Build the Lightning Trainer from the `lightning:` section of the merged config."""

import difflib
import inspect
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import OmegaConf

from ldm.util import instantiate_from_config
from lun.callbacks.defaults import default_callback_configs
from lun.callbacks.signals import SignalCheckpoint
from lun.config import ConfigError
from lun.run import RunDir

TRAINER_ARGS = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
# Built here from other sections; setting them in `lightning.trainer` would be ambiguous.
BUILT_HERE = {"callbacks", "logger", "plugins", "default_root_dir"}


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
    callbacks = [instantiate_from_config(cfg) for cfg in configs.values()]
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
        return instantiate_from_config({"target": logger_cfg["target"], "params": params})
    return TensorBoardLogger(save_dir=str(run.root), name="tensorboard", version="")


def build_trainer(
    lightning_cfg: dict, run: RunDir, has_validation: bool, use_ema: bool = False
) -> Trainer:
    from lun.atomic_io import AtomicCheckpointIO

    kwargs = trainer_kwargs(lightning_cfg)
    try:
        return Trainer(
            **kwargs,
            callbacks=build_callbacks(lightning_cfg, run, has_validation, use_ema),
            logger=build_logger(lightning_cfg, run),
            plugins=[AtomicCheckpointIO()],
            default_root_dir=str(run.root),
        )
    except (ValueError, TypeError) as err:
        # Lightning's own validation (unknown accelerator, bad precision, ...) is a config error.
        raise ConfigError(f"lightning.trainer: {str(err).splitlines()[0]}") from None
