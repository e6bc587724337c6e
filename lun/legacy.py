"""The original launchers' configs and options, translated to ours: Lightning 1.x trainer keys,
the CompVis `main.py` (its data module, `lightning.modelcheckpoint`, `--gpus`,
`resume_from_checkpoint`, its ImageLogger), translunar-diffusion's launcher (`--data_root`,
its callbacks), open-diffusion's dataset keys - each moved to where its meaning lives now,
with one warning line. The model side (CompVis / sgm targets and parameters) is `ldm/compat.py`.
"""

import logging
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lun.errors import ConfigError
from lun.errors import first_line as _first_line

logger = logging.getLogger("lun.config")  # the name the translations' notices always had


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


# --- the trainer block: callbacks -------------------------------------------------------------
# Callback targets of the original launchers (CompVis `main.py`, translunar-diffusion): the
# class that plays the role here. `main.*` names are the launcher's, so they are mapped here and
# not in ldm.util's table of model targets.
LEGACY_CALLBACK_TARGETS = {
    "main.ImageLogger": "lun.callbacks.image_logger.ImageLogger",
    "lun.callbacks.SmoothedProgressBar": "lun.callbacks.progress.SmoothedProgressBar",
    # translunar-diffusion's own ImageLogger (its parameters are the original's, translated below).
    "lun.callbacks.ImageLogger": "lun.callbacks.image_logger.ImageLogger",
}
# The original ImageLogger's parameters: ours of the same meaning, or None (accepted, no effect).
LEGACY_IMAGE_LOGGER_PARAMS = {
    "clamp": None,  # our grids are always clamped to [-1, 1]
    "rescale": None,  # ... and always mapped from [-1, 1] to [0, 255]
    "check_custom_step": None,
    "log_on_batch_idx": None,  # we count optimizer steps
    "log_before_first_step": "log_first_step",
    "val_batch_frequency": None,  # translunar: grids are logged in training only here
    "log_images_to_loggers": None,  # translunar: our grids always go to the loggers too
}
# The original `log_images_kwargs` (passed to the original model's `log_images`).
LEGACY_LOG_IMAGES_KWARGS = {
    "N": "max_images",
    "ddim_steps": "steps",
    "use_ema_scope": "use_ema",
    "unconditional_guidance_scale": "scale",
}
# Lightning's package before 2.0; a config naming it gets the same class from `lightning`.
OLD_LIGHTNING_PREFIX, LIGHTNING_PREFIX = "pytorch_lightning.", "lightning.pytorch."


def callback_target(cfg: dict) -> str:
    """A callback's or logger's target with the old names mapped to the classes used here."""
    target = cfg["target"]
    target = LEGACY_CALLBACK_TARGETS.get(target, target)
    if target.startswith(OLD_LIGHTNING_PREFIX):
        target = LIGHTNING_PREFIX + target[len(OLD_LIGHTNING_PREFIX) :]
    return target


def image_logger_params(key: str, params: dict) -> dict | None:
    """The original ImageLogger's parameters -> ours (None: `disabled: true`, no callback).

    What has a meaning here is honoured (`log_images_kwargs.N` -> `max_images`, `ddim_steps` ->
    `steps`, `use_ema_scope` -> `use_ema`, `unconditional_guidance_scale` -> `scale`); the rest
    is accepted with one warning line naming the key.
    """
    params = dict(params)
    if params.pop("disabled", False):
        return None
    for name, ours in LEGACY_IMAGE_LOGGER_PARAMS.items():
        if name not in params:
            continue
        value = params.pop(name)
        if ours is None:
            logger.warning("%s.params.%s is accepted but has no effect here", key, name)
        else:
            params.setdefault(ours, value)
    kwargs = params.pop("log_images_kwargs", None) or {}
    for name, value in kwargs.items():
        ours = LEGACY_LOG_IMAGES_KWARGS.get(name)
        if ours is None:
            logger.warning(
                "%s.params.log_images_kwargs.%s is accepted but has no effect here", key, name
            )
        elif ours == "max_images" and "max_images" in params:
            params["max_images"] = min(params["max_images"], value)  # both cap the grid
        else:
            params[ours] = value
    return params


# --- the original launchers' options ------------------------------------------------------------
def translate_command_line(cfg: DictConfig, data_root: str | None, gpus: str | None) -> None:
    """The merged config's legacy keys, then the original launchers' `--data_root` and `--gpus`
    (the command line wins over the files' trainer settings), in place."""
    translate_legacy_keys(cfg)
    if data_root is not None:
        set_data_root(cfg, data_root)
    if gpus is not None:
        if OmegaConf.select(cfg, "lightning.trainer", default=None) is None:
            OmegaConf.update(cfg, "lightning.trainer", {}, force_add=True)
        translate_gpus(cfg.lightning.trainer, gpus, "--gpus", wins=True)


# CompVis' main.py parsed its switches with `str2bool` and an optional value.
COMPVIS_SWITCHES = ("-t", "--train", "--scale_lr", "--no-test", "-d", "--debug")
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def fold_switch_values(argv: list[str]) -> list[str]:
    """CompVis' `-t True`, `--scale_lr False`, `--train=yes`: the switch alone, or nothing for a
    false word (`--scale_lr False` is our default). Only a true/false word is taken, so
    `-t key.path=value` stays a switch and an override."""
    folded, i = [], 0
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        if flag in COMPVIS_SWITCHES and not value and i + 1 < len(argv):
            word = argv[i + 1].lower()
            if word in TRUE_WORDS + FALSE_WORDS:
                value, i = word, i + 1
        if flag in COMPVIS_SWITCHES and value.lower() in TRUE_WORDS + FALSE_WORDS:
            folded += [flag] if value.lower() in TRUE_WORDS else []
        else:
            folded.append(argv[i])
        i += 1
    return folded
