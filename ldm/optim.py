"""Optimizers and learning-rate schedules (multipliers stepped once per optimizer step)."""

import importlib.util
import itertools
import math

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ldm.util import check_params, get_obj_from_str, instantiate_from_config

OPTIMIZER_ALIASES = {
    "adamw": "torch.optim.AdamW",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
}


def optimizer_target(config: dict):
    """The dotted path of `optimizer_config`'s target (an alias resolved; AdamW by default)."""
    name = config.get("target", "adamw")
    return OPTIMIZER_ALIASES.get(name, name) if isinstance(name, str) else name


def build_optimizer(
    params, lr: float, config: dict | None = None, fuse: bool = True
) -> torch.optim.Optimizer:
    """`config`: `{target: adamw | adamw8bit | dotted.Path, params: {...}}`; default AdamW(wd=0.01).

    8-bit AdamW (bitsandbytes) stores the two moments in 8 bits: ~75 % less optimizer memory.
    torch's AdamW runs fused (one kernel for all parameters) unless `params: {fused: false}` or
    `fuse=False` (the caller clips gradients under mixed precision, which Lightning refuses for
    an optimizer that unscales internally): on CPU, torch's own default is a Python loop over
    parameters, 4x slower (0.31 s against 0.08 s per step at the benchmark's UNet, 6 % of the
    whole training step).
    """
    config = dict(config or {})
    target = optimizer_target(config)
    kwargs = {"weight_decay": 1e-2, **(config.get("params") or {})}
    package = target.split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"optimizer '{target}' needs the package '{package}': pip install {package}"
        )
    params = list(params)
    if fuse and target == "torch.optim.AdamW" and not {"fused", "foreach"} & kwargs.keys():
        kwargs["fused"] = all(_has_fused_adamw(p) for p in _tensors(params)) or None
    return get_obj_from_str(target)(params, lr=lr, **kwargs)


def check_optimizer_settings(optimizer: dict | None, scheduler: dict | None) -> None:
    """The optimizer's and LR schedule's configs, checked when the module is built: they are only
    used in `configure_optimizers`, inside fit, where a mistyped target or a word for a number
    ends in a traceback. ValueError naming `optimizer_config` / `scheduler_config`."""
    config = dict(optimizer or {})
    target = optimizer_target(config)
    if not isinstance(target, str) or "." not in target:
        raise ValueError(
            f"optimizer_config.target={config.get('target')!r}: expected {' or '.join(OPTIMIZER_ALIASES)} or a "
            "class's dotted path (torch.optim.SGD)"
        )
    if importlib.util.find_spec(target.split(".")[0]) is None:
        # An optional package (bitsandbytes' adamw8bit): sampling, converting and evaluating
        # need no optimizer; a training run's memory plan names the package before its folder.
        return
    try:  # bound to the signature, not built: the module has no parameters to give yet
        kwargs = {"params": [], "lr": 1.0, **(config.get("params") or {})}
        check_params(target, get_obj_from_str(target), kwargs)
    except ValueError as err:
        raise ValueError(f"optimizer_config: {err}") from err
    try:
        if scheduler:
            instantiate_from_config(scheduler)  # a multiplier: plain Python, cheap to build
    except ValueError as err:
        raise ValueError(f"scheduler_config: {err}") from err


def _tensors(params):
    """The tensors of a parameter list or of a list of parameter groups."""
    for item in params:
        yield from item["params"] if isinstance(item, dict) else [item]


def _has_fused_adamw(param: torch.Tensor) -> bool:
    # torch checks only when stepping; these are the devices with the kernel since torch 2.4.
    return param.is_floating_point() and param.device.type in ("cpu", "cuda")


class WarmupScheduler:
    """LR multiplier: linear warm-up, then constant, cosine or linear decay.

    At optimizer step k (from 0): (k + 1) / warmup_steps while k < warmup_steps - the first step
    trains at lr / warmup_steps and the last warm-up step at the full lr, none at lr 0 (diffusers'
    `get_scheduler` is one step behind in the warm-up) - then, with
    p = min(1, (k - warmup_steps) / (total_steps - warmup_steps)), min_factor + (1 - min_factor)
    times (1 + cos(pi p)) / 2 or (1 - p): diffusers' cosine / linear decay (torch's
    CosineAnnealingLR with eta_min for min_factor), held at min_factor after total_steps.

    Args:
        kind: "constant", "cosine" or "linear" (the shape after warm-up).
        warmup_steps: optimizer steps of linear warm-up.
        total_steps: the step where cosine/linear reach `min_factor` (required for those kinds).
        min_factor: multiplier at the end of the decay.
    """

    def __init__(
        self,
        kind: str = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_factor: float = 0.0,
    ):
        if kind not in ("constant", "cosine", "linear"):
            raise ValueError(f"scheduler kind must be constant, cosine or linear, got '{kind}'")
        if kind != "constant" and not total_steps:
            raise ValueError(f"a {kind} schedule needs total_steps")
        self.kind, self.warmup_steps, self.total_steps, self.min_factor = (
            kind,
            warmup_steps,
            total_steps,
            min_factor,
        )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(
            1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        )
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - progress
        return self.min_factor + (1 - self.min_factor) * shape


class LambdaLinearScheduler:
    """The original `ldm.lr_scheduler.LambdaLinearScheduler`: per cycle, linear warm-up from
    `f_start` to `f_max` over `warm_up_steps`, then linear from `f_max` to `f_min` until the
    cycle's end. Lists give one value per cycle."""

    def __init__(self, warm_up_steps, f_min, f_max, f_start, cycle_lengths, verbosity_interval=0):
        self.warm_up_steps, self.f_min, self.f_max = warm_up_steps, f_min, f_max
        self.f_start, self.cycle_lengths = f_start, cycle_lengths
        self.cum_cycles = [0, *itertools.accumulate(cycle_lengths)]

    def __call__(self, step: int) -> float:
        last = len(self.cycle_lengths) - 1
        cycle = next((i for i, end in enumerate(self.cum_cycles[1:]) if step <= end), last)
        step -= self.cum_cycles[cycle]
        if step < self.warm_up_steps[cycle]:
            slope = (self.f_max[cycle] - self.f_start[cycle]) / self.warm_up_steps[cycle]
            return self.f_start[cycle] + slope * step
        fraction = (self.cycle_lengths[cycle] - step) / self.cycle_lengths[cycle]
        return self.f_min[cycle] + (self.f_max[cycle] - self.f_min[cycle]) * fraction


class ConfiguredLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose resume keeps the step count but follows the config.

    torch's LambdaLR restores a callable multiplier's attributes and the base learning rates
    from the checkpoint, over the ones just built from the config: a run resumed with a larger
    `max_steps` (`total_steps: ${lightning.trainer.max_steps}`) would keep the old end of the
    schedule and train the added steps at its floor. Here the config's multiplier and learning
    rates stay, the step count comes from the checkpoint, and a difference is said in one line.
    With an unchanged config the learning rates are bit for bit those of the saved run.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        built = {"base_lrs": list(self.base_lrs), "multiplier": [vars(f) for f in self.lr_lambdas]}
        saved = {"base_lrs": state_dict["base_lrs"], "multiplier": state_dict["lr_lambdas"]}
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})
        self.base_lrs = built["base_lrs"]
        changes = _differences(saved, built)
        if changes:
            rank_zero_info(
                f"LR schedule: the config differs from the checkpoint ({'; '.join(changes)}); "
                f"following the config from step {self.last_epoch}"
            )
        # The optimizer came back with the checkpoint schedule's rate for this step; the config's
        # applies from this step on (the same expression `step()` evaluates).
        self._last_lr = [
            base_lr * multiplier(self.last_epoch)
            for multiplier, base_lr in zip(self.lr_lambdas, self.base_lrs)
        ]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def _differences(saved: dict, built: dict) -> list[str]:
    """One entry per value that differs, such as `total_steps 40 -> 80`."""
    changes = []
    if saved["base_lrs"] != built["base_lrs"]:
        changes.append(f"learning rates {saved['base_lrs']} -> {built['base_lrs']}")
    for old, new in zip(saved["multiplier"], built["multiplier"]):
        if old is None:  # a plain function: torch records nothing of it
            continue
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                changes.append(f"{key} {old.get(key)} -> {new.get(key)}")
    return list(dict.fromkeys(changes))  # one entry for a multiplier shared by all groups


def build_scheduler(optimizer, config: dict | None):
    """A Lightning scheduler dict stepping `LambdaLR(config's multiplier)` every optimizer step
    (a ConfiguredLambdaLR: on resume the config's schedule applies, at the saved step)."""
    if not config:
        return None
    multiplier = instantiate_from_config(config)
    scheduler = ConfiguredLambdaLR(optimizer, lr_lambda=multiplier)
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}
