"""Reading a training checkpoint whatever strategy wrote it (a file, a DeepSpeed folder, a
sharded FSDP folder) - checked for unsafe pickles first - as one Lightning checkpoint dict in
the original layout."""

import importlib.util
from pathlib import Path

from ldm import safe_load
from ldm.layout import original, peft, wrappers
from lun.strategies.common import CALLBACK_STATE_KEY, require


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


def shape_problem(path: str | Path, model, unsafe: bool = False) -> str | None:
    """One line when a checkpoint file to resume holds a tensor of another shape than the built
    model's of the same name: the config changed since the run (a LoRA rank, a width). Lightning
    would fail inside fit, after the run folder took the new config, with a size-mismatch line
    per tensor. The file's tensors stay on disk (memory-mapped: only their shapes are read); the
    module's own hook puts its names in the module's layout (a LoRA run's adapters) first. A
    DeepSpeed or sharded folder is the engines' to read: not checked here."""
    path = Path(path)
    if not path.is_file():
        return None
    state = safe_load.load_file_state(path, unsafe=unsafe, mmap=True).get("state_dict")
    if not isinstance(state, dict):
        return None
    probe = {"state_dict": dict(state)}
    model.on_load_checkpoint(probe)
    own = model.state_dict()
    wrong = [
        (key, tuple(value.shape), tuple(own[key].shape))
        for key, value in probe["state_dict"].items()
        if key in own and hasattr(value, "shape") and tuple(value.shape) != tuple(own[key].shape)
    ]
    if not wrong:
        return None
    key, saved, built = wrong[0]
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    shape = lambda dims: "x".join(map(str, dims)) or "scalar"  # noqa: E731
    return (
        f"--resume: {path} holds {key} as {shape(saved)}, this config builds {shape(built)}"
        f"{more}: the model's settings differ from the run's (a LoRA rank, a width); resume "
        "with the run's settings, or start a new run from its weights (model.params.ckpt_path)"
    )


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
    require("deepspeed", f"{path} is a DeepSpeed checkpoint; merging it")
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
    # A LoRA run: peft's levels out, adapters under `lora.`, as the LoRA mode's checkpoint hook
    # does for files (the engines save the module's own names); other runs' names are kept.
    weights = peft.to_original_layout(weights)
    weights.update(client.get(CALLBACK_STATE_KEY) or {})
    kept = {
        k: v
        for k, v in client.items()
        if k in ("epoch", "global_step", "pytorch-lightning_version")
    }
    return {**kept, "state_dict": weights}
