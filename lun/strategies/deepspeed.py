"""DeepSpeed (ZeRO 1-3) as Lightning runs it, also on the CPU accelerator, with what a
diffusion run needs: the loss scaled by 1/accumulate once (Lightning already divides it;
DeepSpeed's `engine.backward` would divide again); state that callbacks add to
`checkpoint["state_dict"]` (the EMA shadows `model_ema.*`) kept in the checkpoint folder, which
DeepSpeed otherwise drops; frozen parts (VAE, text encoder) keep their exact float32 weights
under mixed precision; a checkpoint folder replaced whole, never half written."""

import argparse
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lun.strategies.checkpoint import check_checkpoint
from lun.strategies.common import (
    CALLBACK_STATE_KEY,
    Sharding,
    callback_entries,
    frozen_children,
    require,
)


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

    # Under fp16 / bf16 the engine casts the parameters to that dtype itself (deepspeed's
    # `_configure_distributed_model`): a training mode leaves their dtype to it.
    casts_parameters = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require("deepspeed", "lightning.strategy: DeepSpeed")
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
        # says (`lun.data.DataModule.batch_size(split)`, asked by its method, so the strategies
        # import no data code). The value only feeds DeepSpeed's throughput log.
        batch_size = getattr(self.lightning_module.trainer.datamodule, "batch_size", None)
        if callable(batch_size):
            return batch_size("train")
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
        _no_shared_memory_all_reduce()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        # DeepSpeed's fp16/bf16 modes cast the whole module to 16 bit (the trained weights keep
        # a float32 master copy in the optimizer). Frozen parts (VAE, frozen text encoder) have
        # none: their float32 values are kept aside and put back, exact, after the cast (not
        # under ZeRO-3, which partitions them).
        mixed = "mixed" in str(self.precision_plugin.precision)
        frozen = frozen_children(model) if mixed and not self.zero_stage_3 else []
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
        extra = callback_entries(checkpoint.get("state_dict") or {}, self.lightning_module)
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


def _no_shared_memory_all_reduce() -> None:
    """On the CPU, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op when it
    starts (`deepspeed.comm.torch.build_shm_op`: g++ for about a minute, on every machine's
    first run). Only its `inference_all_reduce` calls that op; training reduces through
    torch.distributed (gloo here). Marking the op incompatible, as DeepSpeed does itself off
    Linux, skips the build."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
