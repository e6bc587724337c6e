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
these adapters.
"""

import argparse
import difflib
import importlib.util
import inspect
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ldm import safe_load
from ldm.layout import original, peft, wrappers
from ldm.util import get_obj_from_str, instantiate_from_config

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
# What a callback stores in a checkpoint's state dict besides the module's own entries; kept
# under this key in DeepSpeed's client state (its engine saves the module weights itself).
CALLBACK_STATE_KEY = "lun_callback_state_dict"


@dataclass(frozen=True)
class Sharding:
    """How a strategy divides each rank's training state (what the memory plan asks for).

    weights / gradients / optimizer: how many ranks share that part (1: a full copy on every
    rank; a rank holds 1/n of it). The ZeRO paper's three stages are exactly these three
    switches (Rajbhandari et al. 2020, sec. 5 and fig. 1).
    """

    weights: int = 1
    gradients: int = 1
    optimizer: int = 1
    optimizer_on_host: bool = False
    weights_on_host: bool = False
    buckets: int = 0  # DeepSpeed's gradient reduction buffers, values
    full_state_dict_gather: bool = False  # FSDP writes a full checkpoint gathered on rank 0
    half_weights_with_master: bool = (
        False  # DeepSpeed mixed precision: 16-bit weights + fp32 master
    )
    name: str = "single device"

    @property
    def gathers_weights_per_block(self) -> bool:
        """Sharded weights are all-gathered unit by unit for its forward and backward."""
        return self.weights > 1


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


def _require(package: str, why: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{why} needs the package '{package}': pip install {package}")


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy` (all its arguments), also on the CPU accelerator.

    Use from YAML (see `configs/lightning/deepspeed_stage2.yaml`):

        lightning:
          strategy:
            target: lun.strategies.DeepSpeedStrategy
            params: {stage: 2, offload_optimizer: true}

    Args:
        stage: ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also the weights.
        offload_optimizer: keep optimizer states (and the step) in CPU memory.
        offload_parameters: (stage 3) keep the weights in CPU memory between uses.
        **kwargs: the other `lightning.pytorch.strategies.DeepSpeedStrategy` arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _require("deepspeed", "lightning.strategy: DeepSpeed")
        super().__init__(*args, **kwargs)
        if isinstance(self.config, dict):
            # Offloading with the model's own torch optimizer (AdamW) is allowed; DeepSpeed
            # refuses it by default to push its faster DeepSpeedCPUAdam, which a config may name.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    def sharding(self, world: int, local: int) -> Sharding:
        """ZeRO stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights."""
        zero = (self.config or {}).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
        offload_params = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
        buckets = 0
        if stage in (1, 2) and zero.get("contiguous_gradients"):
            # Gradient reduction buffers of `reduce_bucket_size` values, two with overlap_comm
            # (deepspeed.runtime.zero.stage_1_and_2 `setup_buckets`): whatever the model's size.
            copies = 2 if zero.get("overlap_comm") else 1
            buckets = int(zero.get("reduce_bucket_size", 0)) * copies
        return Sharding(
            weights=world if stage >= 3 else 1,
            gradients=world if stage >= 2 else 1,
            optimizer=world if stage >= 1 else 1,
            optimizer_on_host=offload,
            weights_on_host=offload_params,
            buckets=buckets,
            half_weights_with_master=True,
            name=f"DeepSpeed ZeRO-{stage}" + (" + optimizer offload" if offload else ""),
        )

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def _auto_select_batch_size(self) -> int:
        # Lightning reads the train loader's `batch_sampler.batch_size` when the DeepSpeed config
        # has no `train_micro_batch_size_per_gpu` (its "auto", or a user's `config:`); lun.data's
        # batch samplers have none, and a loader built this early is not wanted: the DataModule
        # says. (The value only feeds DeepSpeed's throughput log.)
        from lun.data.datamodule import DataModule

        data = self.lightning_module.trainer.datamodule
        if isinstance(data, DataModule):
            return data.batch_size("train")
        return super()._auto_select_batch_size()

    def setup_environment(self) -> None:
        if not self._on_cpu:
            super().setup_environment()
            return
        # Lightning's refusal of non-CUDA accelerators is all that this skips.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        # CPU devices have no index, so Lightning's check of device index == local rank is moot.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        # DeepSpeed's fp16/bf16 modes cast the whole module to 16 bit (the trained weights keep
        # a float32 master copy in the optimizer). Frozen parts (VAE, frozen text encoder) have
        # none: their float32 values are kept aside and put back, exact, after the cast (not
        # under ZeRO-3, which partitions them).
        mixed = "mixed" in str(self.precision_plugin.precision)
        frozen = _frozen_children(model) if mixed and not self.zero_stage_3 else []
        kept = [
            {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for m in frozen
        ]
        if self._on_cpu:
            engine, ds_optimizer = self._initialize_on_cpu(model, optimizer, lr_scheduler)
        else:
            engine, ds_optimizer = super()._setup_model_and_optimizer(
                model, optimizer, lr_scheduler
            )
        for child, state in zip(frozen, kept):
            child.float().load_state_dict(state)
        if mixed and not getattr(model, "_lun_casts_inputs", False):
            # Unlike autocast, DeepSpeed casts no activations: a float32 input (the timestep
            # embedding, latents of a float32 VAE) would meet 16-bit weights. Each layer casts
            # its floating inputs to its weights' dtype.
            for layer in model.modules():
                if next(layer.parameters(recurse=False), None) is not None:
                    layer.register_forward_pre_hook(_cast_inputs_to_weight_dtype)
            model._lun_casts_inputs = True
        return engine, ds_optimizer

    def _initialize_on_cpu(self, model, optimizer, lr_scheduler):
        import deepspeed

        # Lightning passes `device_rank=root_device.index`, None for the CPU, which DeepSpeed's
        # engine cannot compare; the CPU accelerator takes the local rank.
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        # Lightning's loop has already divided the loss by `accumulate_grad_batches`.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        import deepspeed

        if not isinstance(self.model, deepspeed.DeepSpeedEngine):
            # Failed before the engine existed (e.g. in setup): there is no state to save.
            rank_zero_warn(f"DeepSpeed engine not initialized: {filepath} not written")
            return
        extra = _callback_entries(checkpoint.get("state_dict") or {}, self.lightning_module)
        if extra:
            checkpoint = {**checkpoint, CALLBACK_STATE_KEY: extra}
        # Every rank writes its shards into a folder beside the target, which replaces the
        # target only once whole: a crash or preemption mid-save leaves the previous checkpoint
        # (as lun.atomic_io does for files; the folder is assumed on a shared file system).
        target = Path(self.broadcast(str(filepath)))
        temporary = Path(
            self.broadcast(str(_temporary_folder(target)) if self.is_global_zero else None)
        )
        with warnings.catch_warnings():
            # Lightning's hint on merging ZeRO-3 shards: scripts/convert.py does it (see below).
            warnings.filterwarnings("ignore", message=".*each worker will save a shard")
            super().save_checkpoint(checkpoint, temporary, storage_options)
        self.barrier()
        if self.is_global_zero:
            _replace_folder(temporary, target)
            if self.zero_stage_3 and self._multi_device:
                rank_zero_info(
                    f"{target}: sharded; `scripts/convert.py {target} out.safetensors` merges it"
                )
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        # DeepSpeed's engine unpickles its folder with weights_only=False: checked first, unless
        # the caller trusts it (`Trainer.fit(weights_only=False)`: main.py --unsafe-load).
        check_checkpoint(checkpoint_path, unsafe=weights_only is False)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        extra = checkpoint.pop(CALLBACK_STATE_KEY, None)
        if extra and "state_dict" not in checkpoint:
            # Callbacks (EMA) find their entries where they put them.
            checkpoint["state_dict"] = extra
        return checkpoint


def _temporary_folder(target: Path) -> Path:
    """A hidden, unique sibling of `target`; leftovers of crashed saves of it are removed."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")


def _replace_folder(complete: Path, target: Path) -> None:
    """Put the folder `complete` at `target` (a folder, file or link), the old one deleted after."""
    aside = None
    if target.is_symlink() or target.is_file():
        target.unlink()  # e.g. `last.ckpt` linked to the newest checkpoint: it becomes a folder
    elif target.exists():
        aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(aside)
    complete.rename(target)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _cast_inputs_to_weight_dtype(layer: torch.nn.Module, args: tuple) -> tuple:
    dtype = next(layer.parameters(recurse=False)).dtype
    return tuple(
        a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def _callback_entries(state: dict, module: torch.nn.Module) -> dict:
    """Entries of a checkpoint's state dict that are not the module's own: callbacks put them
    there (the EMA's `model_ema.*`). Told apart by their first name level."""
    own = {name for name, _ in module.named_children()}
    own |= {name for name, _ in module.named_parameters(recurse=False)}
    own |= {name for name, _ in module.named_buffers(recurse=False)}
    return {k: v for k, v in state.items() if k.split(".", 1)[0] not in own}


class _DeviceFSDPPrecision(FSDPPrecision):
    """`FSDPPrecision` whose autocast follows the device (Lightning's is CUDA-only)."""

    def __init__(self, precision, scaler=None, device_type: str = "cuda"):
        super().__init__(precision, scaler)
        self.device_type = device_type

    def forward_context(self) -> AbstractContextManager:
        if "mixed" in self.precision:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            return torch.autocast(self.device_type, dtype=dtype)
        return super().forward_context()


def _trainable_parts(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, Any]]:
    """(parent, name, child) for each child with trainable weights that is called: one with
    its own `forward`. A child without one (a container such as the VAE's loss, whose methods
    call its discriminator) is searched the same way."""
    for name, child in module.named_children():
        if not any(p.requires_grad for p in child.parameters()):
            continue
        if type(child).forward is torch.nn.Module.forward:
            yield from _trainable_parts(child)
        else:
            yield module, name, child


def _frozen_children(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Direct submodules that have parameters, none of them trainable."""
    found = []
    for child in model.children():
        params = list(child.parameters())
        if params and not any(p.requires_grad for p in params):
            found.append(child)
    return found


class FSDPStrategy(LightningFSDPStrategy):
    """torch FSDP (Lightning's `FSDPStrategy`, all its arguments), also on the CPU accelerator.

    Use from YAML (see `configs/lightning/fsdp.yaml`):

        lightning:
          strategy:
            target: lun.strategies.FSDPStrategy
            params:
              auto_wrap_modules: [ldm.unet.TimestepEmbedSequential]
              state_dict_type: full

    Args:
        auto_wrap_modules: class paths; each instance becomes its own FSDP unit (sharded and
            gathered on its own, which bounds peak memory). None: the model is one unit.
        activation_checkpointing_modules: class paths whose instances recompute activations in
            backward (FSDP's checkpoint wrapper; the UNet's own `use_checkpoint` is the simpler
            switch).
        state_dict_type: "full" writes one checkpoint file gathered on rank 0; "sharded" writes
            a folder with one shard per rank (`scripts/convert.py` merges it into one file).
        sharding_strategy: "FULL_SHARD" (ZeRO-3 like), "SHARD_GRAD_OP" (ZeRO-2 like),
            "NO_SHARD", "HYBRID_SHARD".
        cpu_offload: keep the parameter shards in CPU memory.
        **kwargs: the other `lightning.pytorch.strategies.FSDPStrategy` arguments and
            `FullyShardedDataParallel` keyword arguments.
    """

    def __init__(
        self,
        *args: Any,
        auto_wrap_modules: list[str] | None = None,
        activation_checkpointing_modules: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if auto_wrap_modules:
            kwargs["auto_wrap_policy"] = {get_obj_from_str(path) for path in auto_wrap_modules}
        if activation_checkpointing_modules:
            kwargs["activation_checkpointing_policy"] = {
                get_obj_from_str(path) for path in activation_checkpointing_modules
            }
        # The frozen VAE and text encoder can share a unit with the trainable UNet.
        kwargs.setdefault("use_orig_params", True)
        super().__init__(*args, **kwargs)

    def sharding(self, world: int, local: int) -> Sharding:
        """FULL_SHARD shards all three parts over every rank, HYBRID_SHARD over the ranks of one
        machine, SHARD_GRAD_OP gradients and optimizer state only, NO_SHARD nothing (torch FSDP's
        ShardingStrategy)."""
        kind = getattr(self.sharding_strategy, "name", str(self.sharding_strategy))
        shards = {"FULL_SHARD": world, "SHARD_GRAD_OP": world, "HYBRID_SHARD": local}.get(kind, 1)
        offload = bool(getattr(self.cpu_offload, "offload_params", False))
        return Sharding(
            weights=shards if kind in ("FULL_SHARD", "HYBRID_SHARD") else 1,
            gradients=shards,
            optimizer=shards,
            optimizer_on_host=offload,
            weights_on_host=offload,
            full_state_dict_gather=getattr(self, "_state_dict_type", "full") == "full",
            name=f"FSDP {kind}" + (" + CPU offload" if offload else ""),
        )

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) is FSDPPrecision:
            self.precision_plugin = _DeviceFSDPPrecision(
                plugin.precision, plugin.scaler, self.root_device.type
            )
        super().setup_environment()

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if getattr(model, "steps_own_optimizers", False):  # the contract's optimisation mode
            return self._shard_parts(model)
        frozen = _frozen_children(model)
        if frozen:
            # Frozen parts (the VAE, a frozen text encoder) have no gradients or optimizer state
            # to shard: FSDP leaves them whole, in their own dtype (a float32 VAE stays float32
            # under mixed precision), and not moved, so they go to the device here.
            for child in frozen:
                child.to(self.root_device)
            ignored = list(self.kwargs.get("ignored_modules") or [])
            self.kwargs["ignored_modules"] = [*ignored, *frozen]
        if not self._on_cpu:
            return super()._setup_model(model)
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        # Lightning passes `device_id=root_device.index`, None for the CPU, which FSDP reads as
        # "the current CUDA device".
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped

    def _shard_parts(self, model: torch.nn.Module) -> torch.nn.Module:
        """A module that steps its own optimizers (manual optimization: the VAE's generator and
        discriminator) runs its backward passes inside `training_step`. Wrapped whole, that
        would all be inside the root unit's forward, whose weights FSDP cannot take a backward
        through yet ("Expects BACKWARD_PRE or BACKWARD_POST state but got FORWARD"). So each
        trainable part it calls (`_trainable_parts`) becomes its own FSDP root instead (the
        `auto_wrap_modules` nested in it), each called, then differentiated once, as FSDP
        expects; the module itself stays unwrapped. Weights stay float32 as under DDP (the
        precision plugin's autocast gives the mixed precision), so the float32 parts of the
        module's loss stay float32."""
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        model.to(self.root_device)  # what no part holds: frozen parts, buffers
        kwargs = {k: v for k, v in self.kwargs.items() if k != "ignored_modules"}
        if not self._on_cpu:  # every rank starts from rank 0's weights (refused for CPU)
            kwargs.setdefault("sync_module_states", True)
        device = torch.device("cpu") if self._on_cpu else self.root_device
        for parent, name, part in _trainable_parts(model):
            wrapped = FullyShardedDataParallel(
                module=part,
                cpu_offload=self.cpu_offload,
                sharding_strategy=self.sharding_strategy,
                device_id=device,
                **kwargs,
            )
            _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
            setattr(parent, name, wrapped)
        return model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._cpu_safe_full_state_dicts():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        with self._cpu_safe_full_state_dicts():
            return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning reads a full file with a plain unpickler and a sharded folder's `.metadata`
        # with pickle.load: checked first, unless trusted (`Trainer.fit(weights_only=False)`).
        check_checkpoint(checkpoint_path, unsafe=weights_only is False)
        with self._cpu_safe_full_state_dicts():
            loaded = super().load_checkpoint(checkpoint_path, weights_only)
        # Lightning moved the weights into the model and dropped the rest of the state dict;
        # callbacks (EMA) read their entries there: those entries alone are read again.
        path = Path(checkpoint_path)
        if "state_dict" not in loaded and path.is_file():
            from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

            entries = _callback_entries(_lazy_load(path)["state_dict"], self.lightning_module)
            loaded["state_dict"] = _materialize_tensors(entries)
        elif "state_dict" not in loaded and path.is_dir():
            loaded["state_dict"] = self._callback_entries_of_shards(path)
        return loaded

    def _callback_entries_of_shards(self, path: Path) -> dict[str, torch.Tensor]:
        """The callback entries of a sharded checkpoint's state dict (saved under "model")."""
        from torch.distributed.checkpoint import FileSystemReader, load
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = FileSystemReader(path)
        level = wrappers.SHARDED_MODULE_KEY + "."
        stored = {
            key.removeprefix(level): meta
            for key, meta in reader.read_metadata().state_dict_metadata.items()
            if key.startswith(level) and isinstance(meta, TensorStorageMetadata)
        }
        wanted = _callback_entries(stored, self.lightning_module)
        entries = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in wanted.items()}
        if entries:
            # Every rank reads them (a collective).
            load({wrappers.SHARDED_MODULE_KEY: entries}, storage_reader=reader)
        return entries

    @contextmanager
    def _cpu_safe_full_state_dicts(self) -> Iterator[None]:
        """Full state dicts without `offload_to_cpu` when the shards already are on the CPU.

        Lightning always offloads; for CPU parameters FSDP's "offload" aliases the unsharded
        storage that it then frees, and the state dict reads freed memory (a segfault).
        """
        if not self._on_cpu:
            yield
            return
        from lightning.pytorch.strategies import fsdp as lightning_fsdp
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def full_state_dict_context(module, world_size: int, rank0_only: bool = True):
            return FSDP.state_dict_type(
                module=module,
                state_dict_type=StateDictType.FULL_STATE_DICT,
                state_dict_config=FullStateDictConfig(rank0_only=rank0_only),
                optim_state_dict_config=FullOptimStateDictConfig(rank0_only=rank0_only),
            )

        original = lightning_fsdp._get_full_state_dict_context
        lightning_fsdp._get_full_state_dict_context = full_state_dict_context
        try:
            yield
        finally:
            lightning_fsdp._get_full_state_dict_context = original


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


def _deepspeed_records() -> list:
    """Plain records DeepSpeed pickles into its checkpoint files besides tensors (pinned by a
    test); none when DeepSpeed is not installed (its folders then need --unsafe-load)."""
    if importlib.util.find_spec("deepspeed") is None:
        return []
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _deepspeed_tag(path: Path) -> str:
    latest = path / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    return next(path.glob("*/*model_states.pt")).parent.name


def check_checkpoint(path: str | Path, unsafe: bool = False) -> None:
    """Refuse (`ldm.safe_load.UnsafeCheckpointError`, naming the file and the class) a training
    checkpoint with any pickle outside the allow-list, before a loader that would run it does.

    A file is loaded weights-only; a folder has all its pickles checked: every `*.pt` in it and
    in the folder its DeepSpeed `latest` file names (DeepSpeed loads them with
    weights_only=False), and what torch.distributed.checkpoint reads of a sharded FSDP folder.
    Nothing is kept (tensors are memory-mapped), so this costs little. `unsafe`: no check.
    """
    path = Path(path)
    if unsafe or not path.exists():
        return  # a missing checkpoint is the loader's error to report
    if path.is_file():
        safe_load.check_pickle(path)
        return
    records = _deepspeed_records()
    if any(p.name.endswith(".metadata") for p in path.iterdir()):
        safe_load.check_sharded_folder(path, records)
    files = set(path.rglob("*.pt"))
    if (path / "latest").is_file():
        files |= set((path / _deepspeed_tag(path)).rglob("*.pt"))
    for file in sorted(files):
        safe_load.check_pickle(file, records)


def load_training_checkpoint(path: str | Path, unsafe: bool = False, mmap: bool = False) -> dict:
    """Any training checkpoint as one `{"state_dict": ..., "global_step": ...}` dict in CPU memory.

    - a file (DDP, single device, FSDP `state_dict_type: full`): loaded as it is;
    - a DeepSpeed folder (`last.ckpt/checkpoint/*.pt`): the float32 weights merged from every
      rank's ZeRO partitions (stage 1, 2 or 3), with the EMA shadows and step count;
    - a sharded FSDP folder (`.metadata` + shards): merged with torch.distributed.checkpoint.

    The weights come back in the original Stable Diffusion layout. Every pickle is checked with
    `weights_only=True` (the allow-list of `ldm.safe_load`) unless `unsafe`. `mmap`: a file's
    tensors stay in the file until read (a converter reads each once).
    """
    path = Path(path)
    if path.is_file():
        return safe_load.load_file_state(path, unsafe=unsafe, mmap=mmap)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / "latest").is_file() or list(path.glob("*/*model_states.pt")):
        return _merge_deepspeed(path, unsafe)
    if (path / ".metadata").is_file():
        return _merge_fsdp_shards(path, unsafe)
    raise FileNotFoundError(
        f"{path}: neither a checkpoint file nor a DeepSpeed / sharded FSDP folder"
    )


def _merge_deepspeed(path: Path, unsafe: bool) -> dict:
    # DeepSpeed unpickles with weights_only=False; files that load weights-only first hold no
    # code, so its second load cannot run any.
    check_checkpoint(path, unsafe)
    _require("deepspeed", f"{path} is a DeepSpeed checkpoint; merging it")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = _deepspeed_tag(path)
    # Rank 0's model file (`mp_rank_00_*`, `zero_pp_rank_0_*` under ZeRO-3) has the client state.
    client_file = sorted((path / tag).glob("*model_states.pt"))[0]
    client = safe_load.load_file_state(client_file, unsafe, extra_globals=_deepspeed_records())
    state = dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag))
    return _as_lightning_checkpoint(state, client)


def _merge_fsdp_shards(path: Path, unsafe: bool) -> dict:
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    # torch.distributed.checkpoint unpickles `.metadata` and non-tensor entries fully.
    check_checkpoint(path, unsafe)
    merged = _load_distributed_checkpoint(path)
    return _as_lightning_checkpoint(dict(merged.pop(wrappers.SHARDED_MODULE_KEY)), merged)


def _as_lightning_checkpoint(weights: dict, client: dict) -> dict:
    """Merged weights (module names) + the client state Lightning saved beside them."""
    original.from_original_layout(weights)
    if any(peft.is_adapter_name(k) for k in weights):
        # A LoRA run: peft's levels out, adapters under `lora.`, as `ldm.lora.save_layout` does
        # for files (the engines save the module's own names).
        weights = peft.to_original_layout(weights)
    weights.update(client.get(CALLBACK_STATE_KEY) or {})
    kept = {
        k: v
        for k, v in client.items()
        if k in ("epoch", "global_step", "pytorch-lightning_version")
    }
    return {**kept, "state_dict": weights}
