"""torch FSDP as Lightning runs it, also on the CPU accelerator (gloo, `device_id` cpu), with
what a diffusion run needs: wrap and checkpoint policies given as class paths in YAML; frozen
parts (VAE, a frozen text encoder) left out of sharding, so they keep their float32 weights under
mixed precision; each trainable part its own root; the EMA shadows surviving a resume from a full
checkpoint; full state dicts of CPU shards that do not read freed memory."""

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy

from ldm.layout import wrappers
from ldm.util import get_obj_from_str
from lun.strategies.checkpoint import check_checkpoint
from lun.strategies.common import Sharding, callback_entries, frozen_children


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

    # Each unit's parameters become one FlatParameter of one dtype (torch refuses to flatten
    # mixed dtypes), cast by its own MixedPrecision: a training mode leaves their dtype to it.
    casts_parameters = True

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
        frozen = frozen_children(model)
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

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        # A sharded save over a file of the same name (the full checkpoint a run resumed from,
        # then saved as shards): Lightning has every rank unlink that file, and the rank that
        # loses the race dies of FileNotFoundError (test_strategies' FSDP case, now and then).
        # Rank 0 removes it; rank 0's answer decides for all, so every rank meets the barrier.
        path = Path(self.broadcast(str(filepath)))
        if self._state_dict_type == "sharded" and self.broadcast(path.is_file()):
            if self.global_rank == 0:
                path.unlink()
            self.barrier("lun_fsdp_sharded_save")
        super().save_checkpoint(checkpoint, filepath, storage_options)

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

            entries = callback_entries(_lazy_load(path)["state_dict"], self.lightning_module)
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
        wanted = callback_entries(stored, self.lightning_module)
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
