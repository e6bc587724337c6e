"""Weights in and out: safe loading, the original Stable Diffusion layout, EMA selection.

Every key rule lives here (no other file spells a layout prefix):
- Our modules carry the original names (`model.diffusion_model.*`, `first_stage_model.*`,
  `cond_stage_model.*`), so `LatentDiffusion.state_dict()` is an original checkpoint with no
  renaming hooks (hooks would collide with the ones FSDP and DeepSpeed install).
- The v1 text encoder on load: files without the `text_model.` level (transformers >= 5.6
  `CLIPTextModel` names) are accepted, and `embeddings.position_ids` (a constant older files
  carry) is dropped.
- EMA: `model_ema.<name of a parameter of LatentDiffusion.model, dots removed>` shadows the UNet.
- Wrappers: the levels torch.compile, FSDP and activation checkpointing add to parameter names,
  and the "model" level of Lightning's sharded FSDP checkpoints.
- A VAE file: bare or under `first_stage_model.` of a full checkpoint.
"""

import hashlib
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CLIP_PREFIX = "cond_stage_model.transformer."
EMA_PREFIX = "model_ema."
EMA_SCALARS = ("model_ema.decay", "model_ema.num_updates")
BACKBONE_PREFIX = "model."  # LatentDiffusion.model (the wrapper holding `diffusion_model`)
FIRST_STAGE_PREFIX = "first_stage_model."
# Levels that wrappers add to parameter names (torch.compile, FSDP units, FSDP checkpointing).
WRAPPER_LEVELS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# Lightning's sharded FSDP checkpoints store the module's state dict under this key.
SHARDED_MODULE_KEY = "model"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A pickled checkpoint that needs a class outside the allow-list."""


class _InertObject:
    """Stands in for harmless bookkeeping objects that original checkpoints pickled (e.g. the
    Lightning ModelCheckpoint callback): unpickled as plain attribute bags, never executed."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


def _numpy_globals() -> list:
    import numpy as np

    scalar = np.core.multiarray.scalar if hasattr(np, "core") else np._core.multiarray.scalar
    found = [
        scalar,
        np.dtype,
        *(type(np.dtype(t)) for t in ("float32", "float64", "int64", "int32")),
    ]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found.append((scalar, f"{module}.scalar"))
    return found


# What released SD checkpoints and Lightning checkpoints contain besides tensors and builtins.
_INERT_NAMES = (
    "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
)


def _allowed_globals() -> list:
    import codecs

    return [*_numpy_globals(), codecs.encode, *((_InertObject, name) for name in _INERT_NAMES)]


def load_file_state(path: str | Path, unsafe: bool = False) -> dict:
    """The raw contents of a `.safetensors` file or a torch pickle (`.ckpt`, `.pt`, `.bin`).

    Pickles load with `weights_only=True` and a short allow-list; a checkpoint that needs any
    other class is refused with its name unless `unsafe=True` (only for files you trust).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if unsafe:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        detail = next(
            (line for line in str(err).splitlines() if "GLOBAL" in line), str(err).splitlines()[0]
        )
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle ({detail.strip()}); this file holds code, not just weights. "
            "Convert it to .safetensors, or pass --unsafe-load if you trust its source."
        ) from None


def state_dict_of(contents: Mapping) -> dict[str, torch.Tensor]:
    """The flat state dict inside a checkpoint (Lightning/original `{"state_dict": ...}` or flat)."""
    state = contents.get("state_dict", contents)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def conditioner_name(conditioner: torch.nn.Module) -> str:
    """The conditioner's submodule name in `LatentDiffusion`, which its checkpoint keys start
    with: `cond_stage_model` (CompVis: SD 1.x/2.x, one text encoder), unless the conditioner
    names another (`checkpoint_name = "conditioner"` for sgm's `conditioner.embedders.N.*`)."""
    return getattr(conditioner, "checkpoint_name", "cond_stage_model")


def from_original_layout(state: dict, prefix: str = "") -> None:
    """In place: accept both text-encoder forms, drop `position_ids` (a constant, not a weight)."""
    head = prefix + CLIP_PREFIX
    for key in [k for k in state if k.startswith(head)]:
        rest = key[len(head) :]
        if rest.endswith("embeddings.position_ids"):
            del state[key]
        elif not rest.startswith("text_model."):
            state[head + "text_model." + rest] = state.pop(key)


def load_state_dict_pre_hook(module, state: dict, prefix: str, *args) -> None:
    """`LatentDiffusion`'s load hook: original files load strictly (both text-encoder forms,
    no `position_ids`), and the EMA shadows are left to their owner (the EMA callback, or
    `apply_ema`). It only drops or adds the level of keys the module has, so it never collides
    with the hooks of FSDP or DeepSpeed; nothing is renamed on save."""
    from_original_layout(state, prefix)
    for key in [k for k in state if k.startswith(prefix + EMA_PREFIX)]:
        del state[key]


def without_wrapper_levels(name: str) -> str:
    """A parameter name as the bare module has it (levels of torch.compile / FSDP removed)."""
    for level in WRAPPER_LEVELS:
        name = name.replace(level, "")
    return name


def backbone_names(state: Mapping) -> list[str]:
    """The backbone's parameter names (`diffusion_model.*`) in a checkpoint's state dict."""
    return [k.removeprefix(BACKBONE_PREFIX) for k in state if k.startswith(BACKBONE_PREFIX)]


def to_transformers_clip(clip_state: Mapping, text_model: torch.nn.Module) -> dict:
    """A CLIP text state dict in the `text_model.*` form -> the names of the installed
    transformers' `CLIPTextModel` (>= 5.6 has no `text_model.` level), without `position_ids`."""
    has_level = any(k.startswith("text_model.") for k in text_model.state_dict())
    return {
        (k if has_level else k.removeprefix("text_model.")): v
        for k, v in clip_state.items()
        if not k.endswith("position_ids")
    }


def backbone_key(name: str) -> str:
    """`diffusion_model.input_blocks.0.0.weight` -> its checkpoint key `model.diffusion_model...`."""
    return BACKBONE_PREFIX + name


def ema_key(name: str) -> str:
    """`diffusion_model.input_blocks.0.0.weight` -> `model_ema.diffusion_modelinput_blocks00weight`."""
    return EMA_PREFIX + name.replace(".", "")


def has_ema(state: Mapping) -> bool:
    return any(k.startswith(EMA_PREFIX) and k not in EMA_SCALARS for k in state)


def apply_ema(state: dict, unet_names: Iterable[str]) -> dict:
    """Return a state dict whose `model.*` weights are the EMA shadows (original naming rule)."""
    state = dict(state)
    missing = []
    for name in unet_names:
        shadow = ema_key(name)
        if shadow in state:
            state[backbone_key(name)] = state[shadow]
        else:
            missing.append(shadow)
    if missing:
        raise KeyError(
            f"the checkpoint has EMA weights but lacks {len(missing)} of them, e.g. {missing[0]}"
        )
    return without_ema(state)


def without_ema(state: Mapping) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(EMA_PREFIX)}


def load_weights(
    model: torch.nn.Module,
    path: str | Path,
    ema: bool | None = None,
    strict: bool = True,
    unsafe: bool = False,
) -> dict:
    """Load a checkpoint (ours or an original SD one) into a `LatentDiffusion`, strictly.

    Args:
        ema: True: use the EMA shadows (error if absent); None: use them when present; False: never.
    Returns the checkpoint's state dict as loaded (for hashing or inspection).
    """
    state = state_dict_of(load_file_state(path, unsafe=unsafe))
    use_ema = has_ema(state) if ema is None else ema
    if use_ema and not has_ema(state):
        raise KeyError(f"{path}: asked for EMA weights but the checkpoint has none (model_ema.*)")
    unet_names = [n for n, p in model.model.named_parameters()]
    weights = apply_ema(state, unet_names) if use_ema else without_ema(state)
    from_original_layout(weights)
    result = model.load_state_dict(weights, strict=False)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise KeyError(mismatch_message(path, result.missing_keys, result.unexpected_keys))
    return state


def load_first_stage(vae: torch.nn.Module, path: str | Path, ignore_keys=()) -> None:
    """Load a VAE's weights (strict) from a VAE file or a full SD checkpoint (`first_stage_model.*`).

    Files of the original VAE training also carry `loss.*` (LPIPS, discriminator) and EMA keys;
    only the VAE's own names are taken, and every one of them must be there.
    """
    state = state_dict_of(load_file_state(path))
    if any(k.startswith(FIRST_STAGE_PREFIX) for k in state):
        state = {
            k.removeprefix(FIRST_STAGE_PREFIX): v
            for k, v in state.items()
            if k.startswith(FIRST_STAGE_PREFIX)
        }
    own = vae.state_dict()
    state = {
        k: v for k, v in state.items() if k in own and not any(k.startswith(p) for p in ignore_keys)
    }
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(
            f"{path}: not an AutoencoderKL checkpoint for this ddconfig; {len(missing)} keys "
            f"missing, e.g. {missing[:3]}"
        )
    vae.load_state_dict(state, strict=True)


def mismatch_message(path, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{path} does not match the model config"]
    if missing:
        parts.append(f"{len(missing)} missing keys, first: {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys, first: {', '.join(unexpected[:3])}")
    return "; ".join(parts) + " (is --config the right one for this checkpoint?)"


def save_safetensors(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a flat state dict atomically; floating tensors cast to `dtype` when given."""
    path = Path(path)
    out = {}
    for key, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp), metadata=metadata)
    tmp.replace(path)


def file_hash(path: str | Path) -> str:
    """First 10 hex digits of the file's SHA-256 (the AUTOMATIC1111 'Model hash')."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:10]
