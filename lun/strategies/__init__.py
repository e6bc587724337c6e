"""Strategy adapters: DeepSpeed and FSDP from config, on CPU as well as on CUDA/ROCm.

Lightning refuses DeepSpeed and FSDP on a CPU accelerator, although both engines run there:
DeepSpeed picks its CPU accelerator and gloo, torch FSDP shards over gloo once it is told
`device_id=torch.device("cpu")`. The subclasses here lift exactly those refusals when the
accelerator is the CPU (so the same configs run in tests and on a laptop) and otherwise defer to
Lightning, so nothing changes on CUDA or ROCm. They also fix what a diffusion run needs from any
strategy:

- DeepSpeed: the loss is scaled by 1/accumulate once (Lightning already divides it; DeepSpeed's
  `engine.backward` would divide again); state that callbacks add to `checkpoint["state_dict"]`
  (the EMA shadows `model_ema.*`) is kept in the checkpoint folder, which DeepSpeed otherwise
  drops; frozen parts (VAE, text encoder) keep their exact float32 weights under mixed precision.
- FSDP: wrap and checkpoint policies are given as class paths in YAML; frozen parts (VAE, a
  frozen text encoder) are left out of sharding, so they keep their float32 weights under mixed
  precision; the EMA shadows survive a resume from a full checkpoint; full state dicts of CPU
  shards do not read freed memory.

`build_strategy` turns `lightning.strategy` (a name or `{target, params}`) into a strategy and
maps Lightning's names and classes for DeepSpeed and FSDP (and the old alias `fsdp_native`) to
these adapters. This file is what the rest of lun asks of a strategy (`sharding`,
`strategy_kind`, `casts_parameters`, `shards_weights`, `gathered_parameters`): no other file tests a strategy's
class. The adapters are `deepspeed.py` and `fsdp.py`; `checkpoint.py` reads what any of them
wrote; `common.py` is what those share.
"""

import difflib
import inspect
from contextlib import AbstractContextManager, nullcontext

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    Strategy,
    StrategyRegistry,
)
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy

from ldm.util import instantiate_from_config
from lun.strategies.checkpoint import check_checkpoint, load_training_checkpoint, shape_problem
from lun.strategies.common import CALLBACK_STATE_KEY, Sharding
from lun.strategies.deepspeed import DeepSpeedStrategy
from lun.strategies.fsdp import FSDPStrategy

__all__ = [
    "CALLBACK_STATE_KEY",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "Sharding",
    "build_strategy",
    "casts_parameters",
    "check_checkpoint",
    "find_unused_parameters",
    "gathered_parameters",
    "load_training_checkpoint",
    "shape_problem",
    "sharding",
    "shards_weights",
    "strategy_kind",
]


# Names Lightning registers for DeepSpeed (`deepspeed_stage_2_offload`, ...), as the params of
# our adapter: read from Lightning's registry, so every name it knows runs here too (also on CPU).
DEEPSPEED_NAMES = {
    name: dict(entry["init_params"])
    for name, entry in StrategyRegistry.items()
    if entry["strategy"] is LightningDeepSpeedStrategy
}
FSDP_NAMES = {"fsdp": {}, "fsdp_native": {}, "fsdp_cpu_offload": {"cpu_offload": True}}
# `target:` paths that mean these engines; a config written for Lightning then runs on CPU too.
DEEPSPEED_TARGETS = {
    "deepspeed",
    "lightning.pytorch.strategies.DeepSpeedStrategy",
    "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy",
    "pytorch_lightning.strategies.DeepSpeedStrategy",
}
FSDP_TARGETS = {
    "fsdp",
    "fsdp_native",
    "lightning.pytorch.strategies.FSDPStrategy",
    "lightning.pytorch.strategies.fsdp.FSDPStrategy",
    "pytorch_lightning.strategies.FSDPStrategy",
}


def sharding(strategy: Strategy | str, world: int, local: int) -> Sharding:
    """How `strategy` shards over `world` ranks, `local` of them on one machine.

    The adapters below report it themselves; Lightning's own DeepSpeed / FSDP classes (a
    subclass named by `target:`) hold the same settings and read the same way. Every other
    strategy (DDP and friends, one device) keeps full copies on each rank.
    """
    if isinstance(strategy, LightningDeepSpeedStrategy):
        return DeepSpeedStrategy.sharding(strategy, world, local)
    if isinstance(strategy, LightningFSDPStrategy):
        return FSDPStrategy.sharding(strategy, world, local)
    return Sharding(name="DDP" if world > 1 else "single device")


def casts_parameters(strategy: Strategy | str) -> bool:
    """Whether `strategy` holds the parameters in its own form and dtype (FSDP's flat
    parameters, DeepSpeed's cast module): a training mode then leaves their dtype alone (LoRA's
    frozen base, `ldm.adapters.TrainingMode.on_fit_start`). The adapters say it; Lightning's
    own classes (a subclass named by `target:`) do the same; every other strategy does not."""
    if isinstance(strategy, LightningDeepSpeedStrategy):
        return DeepSpeedStrategy.casts_parameters
    if isinstance(strategy, LightningFSDPStrategy):
        return FSDPStrategy.casts_parameters
    return False


def strategy_kind(strategy: Strategy | str) -> str:
    """ "deepspeed", "fsdp", "ddp", "model_parallel" (Lightning's DTensor ModelParallelStrategy)
    or "single": the one place that tells strategies apart by class (a subclass named by
    `target:` is its engine's kind). What a module is asked about (`strategy_problem`) and what
    a callback checks (the EMA refuses model parallel: it cannot gather DTensor weights)."""
    kinds = {
        LightningDeepSpeedStrategy: "deepspeed",
        LightningFSDPStrategy: "fsdp",
        DDPStrategy: "ddp",
        ModelParallelStrategy: "model_parallel",
    }
    return next((kind for cls, kind in kinds.items() if isinstance(strategy, cls)), "single")


def find_unused_parameters(strategy: Strategy | str) -> bool:
    """Whether DDP was told `find_unused_parameters: true` (DDPStrategy keeps its arguments in
    `_ddp_kwargs`); False for every other strategy."""
    return bool(getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters"))


def build_strategy(
    strategy_cfg: str | dict | None, deepspeed_cfg: dict | None = None
) -> str | Strategy:
    """`lightning.strategy` -> what `Trainer(strategy=...)` takes.

    A name ("ddp", "deepspeed_stage_2", "fsdp", ...) or `{target, params}`. DeepSpeed and FSDP
    names and Lightning's classes for them become the adapters of this module; other names go to
    Lightning unchanged. `deepspeed_cfg` (`lightning.deepspeed`, as translunar-diffusion writes
    it) holds DeepSpeed arguments: they override those a name implies
    (`deepspeed` + `{stage: 1, offload_optimizer: true}` is stage 1 with offload), and alone they
    mean DeepSpeed. Raises ValueError when they are given with another strategy or name an
    argument DeepSpeedStrategy lacks, ImportError (naming the pip package) when DeepSpeed is
    asked for and not installed.
    """
    if deepspeed_cfg:
        return _deepspeed_from_config(strategy_cfg or "deepspeed", dict(deepspeed_cfg))
    if isinstance(strategy_cfg, str):
        if strategy_cfg in DEEPSPEED_NAMES:
            return _deepspeed(DEEPSPEED_NAMES[strategy_cfg])
        if strategy_cfg in FSDP_NAMES:
            return FSDPStrategy(**FSDP_NAMES[strategy_cfg])
        return strategy_cfg
    target, params = strategy_cfg.get("target"), dict(strategy_cfg.get("params") or {})
    if target in DEEPSPEED_TARGETS:
        return _deepspeed(params)
    if target in FSDP_TARGETS:
        return FSDPStrategy(**params)
    return instantiate_from_config(strategy_cfg)


def _deepspeed(params: dict) -> "DeepSpeedStrategy":
    return DeepSpeedStrategy(**params)


def _deepspeed_from_config(strategy_cfg: str | dict, deepspeed_cfg: dict) -> Strategy:
    if isinstance(strategy_cfg, str) and strategy_cfg in DEEPSPEED_NAMES:
        params = dict(DEEPSPEED_NAMES[strategy_cfg])
    elif isinstance(strategy_cfg, dict) and strategy_cfg.get("target") in DEEPSPEED_TARGETS:
        params = dict(strategy_cfg.get("params") or {})
    else:
        name = strategy_cfg if isinstance(strategy_cfg, str) else strategy_cfg.get("target")
        raise ValueError(f"set for strategy '{name}'; DeepSpeed arguments need strategy: deepspeed")
    accepted = inspect.signature(LightningDeepSpeedStrategy.__init__).parameters
    for name in deepspeed_cfg:
        if name not in accepted or name == "self":
            near = difflib.get_close_matches(name, list(accepted), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(f"{name}: not a DeepSpeedStrategy argument{hint}")
    return _deepspeed({**params, **deepspeed_cfg})


def shards_weights(strategy: Strategy) -> bool:
    """Whether ranks hold only shards of the weights (FSDP, ZeRO-3)."""
    return isinstance(strategy, LightningFSDPStrategy) or bool(
        getattr(strategy, "zero_stage_3", False)
    )


def gathered_parameters(
    strategy: Strategy, params: dict[str, torch.nn.Parameter], modify: bool = False
) -> AbstractContextManager:
    """A block in which `params` hold their full (unsharded) values on every rank.

    DDP and ZeRO-1/2 keep full weights everywhere: nothing to do. FSDP and ZeRO-3 gather them
    (a collective: every rank must enter). With `modify`, values written inside the block are
    sharded back on exit (from rank 0 for ZeRO-3; every rank writes the same values).
    """
    if isinstance(strategy, LightningFSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(strategy.model, writeback=modify)
    if getattr(strategy, "zero_stage_3", False):
        import deepspeed

        return deepspeed.zero.GatheredParameters(
            list(params.values()), modifier_rank=0 if modify else None
        )
    return nullcontext()
