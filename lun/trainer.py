"""Build the run's parts from the merged config: the data (its datasets indexed and probed), the
Lightning Trainer from the `lightning:` section, and the model.

Everything here runs before the launcher creates the run folder, so a bad value is one config
error line (lun.config.config_errors) and never a traceback inside `fit` beside a fresh
checkpoint: values Lightning or the data loaders would only check when training starts are
checked here first.
"""

import difflib
import inspect
import logging
import os
import re
import typing
from typing import Any

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

from ldm.config_errors import is_count, is_number
from ldm.optim import check_optimizer_settings
from ldm.util import get_obj_from_str, instantiate_from_config
from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.defaults import default_callback_configs
from lun.callbacks.signals import SignalCheckpoint
from lun.config import ConfigError, config_errors
from lun.data.datamodule import DataModule, check_loader_settings
from lun.legacy import callback_target, image_logger_params
from lun.run import RunDir

logger = logging.getLogger(__name__)

IMAGE_LOGGER = "lun.callbacks.image_logger.ImageLogger"
CHECKPOINT = "lun.callbacks.checkpoints.Checkpoint"
# Lightning's ModelCheckpoint defaults where our Checkpoint's differ.
LIGHTNING_CHECKPOINT_DEFAULTS = {
    "filename": "{epoch}-{step}",
    "auto_insert_metric_name": True,
    "enable_version_counter": True,
}

TRAINER_PARAMETERS = dict(inspect.signature(Trainer.__init__).parameters)
TRAINER_ARGS = set(TRAINER_PARAMETERS) - {"self"}
# Built here from other sections; setting them in `lightning.trainer` would be ambiguous.
BUILT_HERE = {"callbacks", "logger", "plugins", "default_root_dir"}
# Counts Lightning checks only once `fit` runs (or first compares with `<`): the lowest value
# allowed, and what -1 means where it is allowed. null is allowed where Trainer's type says so.
# max_steps / max_epochs 0 are Lightning's "train nothing": a run folder and no step, silently.
TRAINER_COUNTS = {
    "max_steps": (1, "no limit"),
    "max_epochs": (1, "no limit"),
    "min_steps": (0, ""),
    "min_epochs": (0, ""),
    "accumulate_grad_batches": (1, ""),
    "num_nodes": (1, ""),
    "check_val_every_n_epoch": (1, ""),
    "num_sanity_val_steps": (0, "all batches"),
    "log_every_n_steps": (0, ""),
    "reload_dataloaders_every_n_epochs": (0, ""),
}
# split -> the setup stage that builds it; "fit" also builds validation, so it comes last.
SPLITS = {"validation": "validate", "test": "test", "train": "fit"}


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
    """`model` -> the LightningModule; a value its constructors refuse is a config error. The
    optimizer and LR schedule settings are checked here, for the runs this builds, not by the
    module: they are only read inside fit, and a module built to sample or convert need not
    import the optimizer's package (bitsandbytes for adamw8bit)."""
    check_target("model", config, LightningModule)
    params = config.get("params") or {}
    with config_errors("model", config):
        check_optimizer_settings(params.get("optimizer_config"), params.get("scheduler_config"))
        return _built("model", config, instantiate_from_config(config), LightningModule)


def build_data(config: dict) -> LightningDataModule:
    """`data` -> the DataModule. A lun.data.DataModule's loader settings are checked and its
    datasets built now (indexing, and a first image decoded where the dataset can
    `check_readable`), so a missing folder or a dataset without one usable image is a config
    error naming its key; Lightning's `setup` then finds them built."""
    check_target("data", config, LightningDataModule)
    from lun.prior_images import draw_missing_class_images  # imports the sampling code

    with config_errors("data", config):
        draw_missing_class_images(config)  # the data reads folders: what it lacks is drawn first
    with config_errors("data", config):
        data = _built("data", config, instantiate_from_config(config), LightningDataModule)
    if not isinstance(data, DataModule):
        return data
    params = config.get("params") or {}
    check_loader_settings("data.params", params)
    for split, stage in SPLITS.items():
        if params.get(split) is None:
            continue
        key = f"data.params.{split}"
        check_loader_settings(key, params[split], split=True)
        with config_errors(key, params[split]):
            data.setup(stage)
            check_readable = getattr(data.datasets[split], "check_readable", None)
            if check_readable is not None:
                check_readable()
    return data


def _check_trainer_values(kwargs: dict) -> None:
    for name, (lowest, minus_one) in TRAINER_COUNTS.items():
        if name not in kwargs:
            continue
        value = kwargs[name]
        nullable = type(None) in typing.get_args(TRAINER_PARAMETERS[name].annotation)
        if (value is None and nullable) or is_count(value, lowest):
            continue
        if minus_one and is_count(value, -1) and value == -1:
            continue
        allowed = [f"a whole number >= {lowest}"]
        allowed += [f"-1 for {minus_one}"] * bool(minus_one) + ["null"] * nullable
        allowed = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
        raise ConfigError(f"lightning.trainer.{name}={value!r}: expected {allowed}")
    _check_clip_value(kwargs.get("gradient_clip_val"))
    _check_accelerator(kwargs.get("accelerator"))


def _check_clip_value(value) -> None:
    """Lightning skips clipping at a value <= 0 without a word: a negative one (a typo, or -1
    meant as "off") would train unclipped. 0 and null mean no clipping, as in Lightning."""
    if value is not None and not (is_number(value) and value >= 0):
        raise ConfigError(f"{CLIP_KEY}={value!r}: expected a number > 0 (0 or null: no clipping)")


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
    deepspeed = lightning_cfg.get("deepspeed")
    if deepspeed is not None and not isinstance(deepspeed, dict):
        raise ConfigError("lightning.deepspeed: expected a mapping of DeepSpeedStrategy arguments")
    if strategy or deepspeed:
        kwargs["strategy"] = _build_strategy(strategy, deepspeed)
    return kwargs


def _build_strategy(strategy_cfg, deepspeed_cfg: dict | None = None):
    """`lightning.strategy` is a name ('ddp') or a `{target, params}` mapping; DeepSpeed and FSDP
    become the adapters of `lun.strategies` (which also run on CPU). `lightning.deepspeed`
    (translunar-diffusion's place: `{stage: 1, offload_optimizer: true}`) holds the DeepSpeed
    strategy's arguments."""
    from lun.strategies import build_strategy

    key = "lightning.deepspeed" if deepspeed_cfg else "lightning.strategy"
    try:
        with config_errors(key, deepspeed_cfg or strategy_cfg):
            return build_strategy(strategy_cfg, deepspeed_cfg)
    except ImportError as err:  # e.g. DeepSpeed asked for and not installed
        raise ConfigError(f"lightning.strategy: {err}") from None


def _class_of(key: str, target: str):
    with config_errors(key):
        obj = get_obj_from_str(target)
    return obj if isinstance(obj, type) else None


def _checkpoint_params(key: str, cls: type, params: dict, run: RunDir) -> dict:
    """A ModelCheckpoint's params: every name checked against ModelCheckpoint's signature (ours
    passes the rest on as **kwargs), `dirpath` the run's `checkpoints/` when not given (as in
    the original launcher; Lightning would pick the logger's folder), and metric names with a
    `/` auto-inserted into the file name as `val_loss=` (not a `val/` folder)."""
    accepted = set(inspect.signature(ModelCheckpoint.__init__).parameters)
    accepted |= set(inspect.signature(cls.__init__).parameters)
    for name in params:
        if name not in accepted:
            near = difflib.get_close_matches(name, accepted - {"self", "kwargs"}, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{key}.params.{name}: not a ModelCheckpoint argument{hint}")
    params = dict(params)
    if params.get("dirpath") is None:
        params["dirpath"] = str(run.checkpoints)
    insert = params.get(
        "auto_insert_metric_name",
        inspect.signature(cls.__init__).parameters.get("auto_insert_metric_name").default,
    )
    filename = params.get("filename")
    if insert and isinstance(filename, str) and "/" in "".join(re.findall(r"\{[^}]*\}", filename)):
        params["filename"] = re.sub(
            r"\{([^:}]+)([^}]*)\}",
            lambda m: f"{m.group(1).replace('/', '_')}={{{m.group(1)}{m.group(2)}}}",
            filename,
        )
        params["auto_insert_metric_name"] = False
    return params


# A checkpoint's save triggers, which ModelCheckpoint takes one at a time: one the user sets
# replaces the default's (every 2000 steps), instead of being refused beside it.
SAVE_TRIGGERS = (
    "every_n_train_steps",
    "every_n_epochs",
    "train_time_interval",
    "save_every_n_samples",
)


def _merged_override(default: dict, override: dict) -> dict:
    """A default callback's config with the user's keys over it; a save trigger of the user's
    (`every_n_epochs: 1`, `save_every_n_samples: 1000`) replaces the default's triggers."""
    params = override.get("params") or {}
    if any(key in params for key in SAVE_TRIGGERS):
        kept = {k: v for k, v in (default.get("params") or {}).items() if k not in SAVE_TRIGGERS}
        default = {**default, "params": kept}
    return OmegaConf.to_container(OmegaConf.merge(default, override))


def build_callbacks(lightning_cfg: dict, run: RunDir, has_validation: bool, use_ema: bool) -> list:
    """Default callbacks merged with `lightning.callbacks` (same name overrides, null removes).

    Configs of the original launchers work as they document: `main.ImageLogger` and its
    parameters, `pytorch_lightning.*` paths, a progress bar of the user's (under any name)
    replacing ours, ModelCheckpoints without a `dirpath` writing into the run's `checkpoints/`.
    """
    configs = default_callback_configs(str(run.root), has_validation, use_ema=use_ema)
    if lightning_cfg.get("logger") is False:
        configs.pop("learning_rate_logger")  # it has nowhere to log
    for name, cfg in (lightning_cfg.get("callbacks") or {}).items():
        if cfg is None:
            configs.pop(name, None)
            continue
        if not isinstance(cfg, dict):
            raise ConfigError(f"lightning.callbacks.{name}: expected a mapping with a 'target'")
        if "target" in cfg:
            cfg = {**cfg, "target": callback_target(cfg)}
        if "target" in cfg and cfg["target"] != configs.get(name, {}).get("target"):
            configs[name] = cfg  # another class: its own params only
        else:  # a partial override (e.g. only `params.every_n_train_steps`) keeps the rest
            configs[name] = _merged_override(configs.get(name, {}), cfg)
    user_bars = [
        name
        for name, cfg in configs.items()
        if name != "progress_bar"
        and "target" in cfg
        and issubclass(
            _class_of(f"lightning.callbacks.{name}", cfg["target"]) or object, ProgressBar
        )
    ]
    if user_bars:
        configs.pop("progress_bar", None)  # Lightning allows one progress bar: the user's
    callbacks, names = [], {}
    for name, cfg in configs.items():
        key = f"lightning.callbacks.{name}"
        if "target" not in cfg:
            raise ConfigError(f"{key}.target: missing; expected the path of a Callback class")
        cls = _class_of(key, cfg["target"])
        params = cfg.get("params") or {}
        if cfg["target"] == IMAGE_LOGGER:
            params = image_logger_params(key, params)
            if params is None:
                continue
        elif cls is not None and issubclass(cls, ModelCheckpoint):
            if cls is ModelCheckpoint:
                # Built as ours with Lightning's defaults: the same files, written atomically,
                # and a state key that tells apart two that differ only by `filename` (Lightning
                # refuses those: "more than one stateful callback of type ModelCheckpoint").
                cfg = {**cfg, "target": CHECKPOINT}
                params = {**LIGHTNING_CHECKPOINT_DEFAULTS, **params}
                if params["filename"] is None:
                    params["filename"] = LIGHTNING_CHECKPOINT_DEFAULTS["filename"]
                cls = Checkpoint
            params = _checkpoint_params(key, cls, params, run)
        with config_errors(key, cfg):
            callback = instantiate_from_config({"target": cfg["target"], "params": params})
        callbacks.append(callback)
        names[id(callback)] = name
    _tell_checkpoints_apart(callbacks, names)
    # Always on: crashes and Ctrl-C leave a checkpoint; SIGUSR1 saves and goes on.
    callbacks.append(SignalCheckpoint(dirpath=str(run.checkpoints)))
    return callbacks


def _tell_checkpoints_apart(callbacks: list, names: dict[int, str]) -> None:
    """Checkpoints whose settings give the same state key (e.g. two periodic ones that differ
    only by `dirpath` or `save_top_k`, which Lightning refuses as "more than one stateful
    callback") are told apart by their config names; those that would write the same files
    are a config error."""
    same_key: dict[str, list] = {}
    for callback in callbacks:
        if isinstance(callback, Checkpoint):
            same_key.setdefault(callback.state_key, []).append(callback)
    for group in same_key.values():
        if len(group) < 2:
            continue
        files = {}
        for callback in group:
            where = (
                os.path.abspath(callback.dirpath or ""),
                callback.save_top_k,
                callback.save_last,
            )
            if where in files:
                raise ConfigError(
                    f"lightning.callbacks.{names[id(callback)]}: saves the same files as "
                    f"lightning.callbacks.{names[id(files[where])]}; remove one of them"
                )
            files[where] = callback
            callback.config_name = names[id(callback)]


def build_logger(lightning_cfg: dict, run: RunDir):
    """TensorBoard under the run folder unless `lightning.logger` says otherwise: false (none),
    one `{target, params}`, or - as the original launchers write it - a mapping of named
    loggers (`{tensorboard: {target, params}, ...}`). `save_dir` defaults to the run folder;
    every parameter is checked here, before any logger writes."""
    logger_cfg = lightning_cfg.get("logger")
    if logger_cfg is False:
        return False
    if not logger_cfg:
        return TensorBoardLogger(save_dir=str(run.root), name="tensorboard", version="")
    if not isinstance(logger_cfg, dict):
        raise ConfigError("lightning.logger: expected false, {target, params} or named loggers")
    if "target" in logger_cfg:
        return _build_one_logger("lightning.logger", logger_cfg, run)
    loggers = []
    for name, cfg in logger_cfg.items():
        if cfg is None:
            continue
        if not isinstance(cfg, dict) or "target" not in cfg:
            raise ConfigError(f"lightning.logger.{name}.target: missing; expected a Logger class")
        loggers.append(_build_one_logger(f"lightning.logger.{name}", cfg, run))
    return loggers or False


def _build_one_logger(key: str, cfg: dict, run: RunDir):
    target = callback_target(cfg)
    params = {"save_dir": str(run.root), **(cfg.get("params") or {})}
    cls = _class_of(key, target)
    if cls is not None and issubclass(cls, TensorBoardLogger):
        # Its **kwargs go to SummaryWriter (flush_secs, max_queue, ...), which would only refuse
        # an unknown one at the first write.
        from torch.utils.tensorboard import SummaryWriter

        accepted = set(inspect.signature(cls.__init__).parameters)
        accepted |= set(inspect.signature(SummaryWriter.__init__).parameters)
        for name in params:
            if name not in accepted:
                raise ConfigError(f"{key}.params.{name}: not a {cls.__name__} argument")
    with config_errors(key, cfg):
        return instantiate_from_config({"target": target, "params": params})


CLIP_KEY = "lightning.trainer.gradient_clip_val"


def fsdp_clipping(kwargs: dict):
    """For Trainer `kwargs` whose strategy is FSDP and which clip by norm (the default
    algorithm): take `gradient_clip_val` out of them and return the callback that clips
    instead; otherwise None (kwargs unchanged)."""
    from lun.strategies import strategy_kind

    value = kwargs.get("gradient_clip_val")
    algorithm = kwargs.get("gradient_clip_algorithm") or "norm"
    if not value or algorithm != "norm" or strategy_kind(kwargs.get("strategy")) != "fsdp":
        return None
    kwargs.pop("gradient_clip_val")
    kwargs.pop("gradient_clip_algorithm", None)
    return FSDPGradientClipping(float(value))


def clipping_problem(model, trainer) -> str | None:
    """Why `trainer` cannot clip `model`'s gradients (None: it can, or nothing is clipped). A
    module that steps its own optimizers (manual optimization: the VAE) is never clipped by
    Lightning: its fit would stop on the first batch, after the run folder was made."""
    clips = trainer.gradient_clip_val is not None or any(
        isinstance(callback, FSDPGradientClipping) for callback in trainer.callbacks
    )
    if clips and not model.automatic_optimization:
        return (
            f"{CLIP_KEY}: {type(model).__name__} steps its own optimizers (manual "
            "optimization), which Lightning does not clip; remove gradient_clip_val"
        )
    return None


def image_size_problem(model, data) -> str | None:
    """Why an image size of `data`'s datasets cannot go through `model` (None: each fits): a
    side that is no multiple of the model's size multiple (`latent_shape` says which) would
    stop the first step, after the run folder was made. The sizes are a dataset's aspect
    buckets (`bucket_sizes`, (width, height)) or its square `size`; cached latents are checked
    against the model by their own fingerprint (`check_cached_data`)."""
    for split, dataset in (getattr(data, "datasets", None) or {}).items():
        size = getattr(dataset, "size", None)
        buckets = getattr(dataset, "bucket_sizes", None)
        sizes = buckets or ([(size, size)] if isinstance(size, int) else [])
        for width, height in sizes:
            try:
                model.latent_shape(height, width)
            except ValueError as err:
                key = f"data.params.{split}.params"
                if len(sizes) > 1 or (width, height) != (size, size):
                    return f"{key}.buckets: the bucket {width}x{height}: {err}; change buckets.step"
                return f"{key}.size={size}: {err}"
    return None


class FSDPGradientClipping(Callback):
    """Clip the gradient's total norm (all ranks' shards) to `max_norm` before each optimizer
    step, with FSDP's own `clip_grad_norm_` on the root unit.

    Lightning's FSDP precision plugin refuses clipping by norm ("gradient_clip_algorithm='norm'
    is currently not supported for FSDPPrecision"): with sharded gradients each rank holds a
    part of every gradient, so the whole gradient's norm needs the squared norms of all shards
    summed across ranks - `torch.nn.utils.clip_grad_norm_` on one rank's shards (what the plugin
    would call) clips by the wrong norm. FSDP's `clip_grad_norm_` on the root unit does it right
    (torch docs, "Gradient Clipping"), but the plugin has no reference to that root. So
    `build_trainer` hands an FSDP run's `gradient_clip_val` to this callback instead of the
    Trainer: after the backward (and the loss scaler's unscale, under 16-mixed) and before the
    optimizer step, on every rank, it clips: the same result as `gradient_clip_val` under DDP.
    """

    def __init__(self, max_norm: float):
        if not max_norm > 0:
            raise ConfigError(
                f"{CLIP_KEY}={max_norm!r}: expected a number > 0 (0 or null: no clipping)"
            )
        self.max_norm = max_norm
        self._root = None  # the wrapped model's root FSDP unit, found once per fit

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._root = None
        if stage == "fit" and (problem := clipping_problem(pl_module, trainer)):
            raise ValueError(problem)  # a bare Trainer's fit; main.py asks before the run folder

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._root is None:  # not per step: finding it walks every module
            from torch.distributed.fsdp import FullyShardedDataParallel

            roots = FullyShardedDataParallel.fsdp_modules(trainer.strategy.model, root_only=True)
            if len(roots) != 1:
                raise RuntimeError(f"{CLIP_KEY}: expected one FSDP root unit, found {len(roots)}")
            self._root = roots[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and _optimizer_handles_unscaling(optimizer):
            # Lightning leaves the unscale to such an optimizer's step: unscale here, to clip
            # true gradients (the scaler then steps it without unscaling again).
            scaler.unscale_(optimizer)
        with torch.no_grad():
            self._root.clip_grad_norm_(self.max_norm)


def build_trainer(
    lightning_cfg: dict, run: RunDir, has_validation: bool, use_ema: bool = False
) -> Trainer:
    from lun.atomic_io import AtomicCheckpointIO

    kwargs = trainer_kwargs(lightning_cfg)
    if not has_validation and kwargs.get("val_check_interval") is not None:
        # Lightning checks it against the epoch's batch count even with nothing to validate
        # (translunar's `val_check_interval: 2000` on a small set stopped the run at start).
        logging.getLogger(__name__).warning(
            "lightning.trainer.val_check_interval has no effect without validation data"
        )
        kwargs.pop("val_check_interval")
    callbacks = build_callbacks(lightning_cfg, run, has_validation, use_ema)
    clipping = fsdp_clipping(kwargs)  # Lightning's FSDP plugin refuses clipping by norm
    if clipping is not None:
        callbacks.append(clipping)
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
