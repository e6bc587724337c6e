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
- A VAE file: bare or under `first_stage_model.` of a full checkpoint, or in diffusers'
  `AutoencoderKL` names (the rules in `ldm/layout/diffusers_vae.py`).
- A backbone file: the backbone's own names with no prefix (the released DiT `.pt`), or DiT's
  `train.py` checkpoint (`{"model", "ema", "opt", "args"}`).
- LoRA (peft): a wrapped layer's weights keep their original names (peft's `base_layer.` level
  removed) and its adapter weights go apart, under `lora.` + the layer's original name +
  `lora_A.weight` / `lora_B.weight` / `lora_magnitude_vector.weight` (peft's adapter-name level
  removed), so a LoRA run's checkpoint is still an original one with extra keys. Renamed by the
  model's checkpoint hooks (`ldm.lora`), not by state-dict hooks.
"""

import hashlib
import io
import json
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ldm.layout import diffusers_vae, family

CLIP_PREFIX = "cond_stage_model.transformer."
# SDXL (sgm): its CLIP ViT-L is embedder 0, and sgm-trained files may add the constant
# `denoiser.sigmas` (sqrt((1 - alphas_cumprod) / alphas_cumprod), not a weight).
SGM_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SGM_OPENCLIP_PREFIX = "conditioner.embedders.1.model."  # SDXL's OpenCLIP bigG text tower
SGM_CONSTANTS = ("denoiser.sigmas",)
OPENCLIP_PREFIX = "cond_stage_model.model."  # SD 2.x's OpenCLIP text tower
EMA_PREFIX = "model_ema."
EMA_SCALARS = ("model_ema.decay", "model_ema.num_updates")
BACKBONE_PREFIX = "model."  # LatentDiffusion.model (the wrapper holding `diffusion_model`)
FIRST_STAGE_PREFIX = "first_stage_model."
# Levels that wrappers add to parameter names (torch.compile, FSDP units, FSDP checkpointing).
WRAPPER_LEVELS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# Lightning's sharded FSDP checkpoints store the module's state dict under this key.
SHARDED_MODULE_KEY = "model"
# LoRA adapters (ldm.lora): their weights' checkpoint prefix, and the levels peft adds.
LORA_PREFIX = "lora."
PEFT_BASE_LEVEL = "base_layer."
PEFT_ADAPTER_LEVEL = re.compile(r"\.(lora_A|lora_B|lora_magnitude_vector)\.[^.]+\.")


class WrongFileError(ValueError):
    """A weights file of another family or kind than the model's (`check_family`)."""


def check_family(
    path,
    found: str | None,
    expected: str | None,
    what: str = "",
    expected_text: str = "",
    hint: str = "",
) -> None:
    """Refuse (WrongFileError, one line naming both) a file whose family (`ldm.layout.family`)
    is known and is not the model's: an SDXL file for an SD 1.x config, a VAE or LoRA file given
    as a model. Unknown families pass: strict loading names what does not match."""
    if found is None or expected is None or found == expected:
        return
    name = f"{what} {path}" if what else str(path)
    expected_text = expected_text or f"{family.a(expected)} checkpoint, as the config's model is"
    hint = hint or family.USE.get(found) or f"give the config of {family.a(found)} model"
    raise WrongFileError(
        f"{name} is {family.describe(path, found)}, expected {expected_text}; {hint}"
    )


def model_family_of(model: torch.nn.Module) -> str | None:
    """The family of a built model, by its own checkpoint keys."""
    return family.model_family(model.state_dict().keys())


def config_family(model_config: Mapping) -> str | None:
    """The family of the model a config builds: built on the meta device (names and shapes, no
    memory, no weights loaded), its keys asked."""
    import copy

    from ldm.util import instantiate_from_config

    model_config = copy.deepcopy(dict(model_config))
    model_config["params"] = {**(model_config.get("params") or {}), "ckpt_path": None}
    try:
        with torch.device("meta"):
            model = instantiate_from_config(model_config)
    except Exception:  # noqa: BLE001 - a part that reads files or data as it is built
        return None  # unknown: the strict load that follows names any mismatch
    return model_family_of(model)


# The weights files a model config may name (model.params...), checked before anything is built.
CONFIG_FILES = ("ckpt_path", "first_stage_config.params.ckpt_path")


def check_config_files(
    model_config: Mapping, resume=None, unsafe: bool = False, resume_flag: str = "--resume"
) -> None:
    """The weights files a model config names (and `--resume`'s checkpoint), before anything
    is built: one that is not there, or of another family than the config's model, is a
    WrongFileError naming the key (a mistyped `model.params.ckpt_path` would otherwise end in a
    traceback after building, an SDXL file for an SD config in a size-mismatch dump)."""
    for key in CONFIG_FILES:
        value = model_config.get("params") or {}
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value and not Path(value).exists():
            raise WrongFileError(f"model.params.{key}: {value}: no such file")
    named = {"model.params.ckpt_path": (model_config.get("params") or {}).get("ckpt_path")}
    named[resume_flag] = resume
    named = {what: path for what, path in named.items() if path}
    if not named:
        return
    expected = config_family(model_config)
    for what, path in named.items():
        found = family.file_family(path, unsafe)
        if expected == family.VAE and found != family.LORA and what != resume_flag:
            continue  # a VAE run starts from a VAE or from any model's first_stage_model.*
        check_family(path, found, expected, what)


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
    "argparse.Namespace",  # the `args` of DiT's train.py checkpoints
    "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
)


def _allowed_globals() -> list:
    import codecs

    return [*_numpy_globals(), codecs.encode, *((_InertObject, name) for name in _INERT_NAMES)]


def global_names(entries: Iterable) -> list[str]:
    """The names under which `torch.serialization.safe_globals` entries admit classes."""
    return sorted(
        {e[1] if isinstance(e, tuple) else f"{e.__module__}.{e.__qualname__}" for e in entries}
    )


def allowed_global_names() -> list[str]:
    """What pickles may ask for beyond torch's own weights-only set (pinned by a test)."""
    return global_names(_allowed_globals())


def _refusal(path, err: Exception, what: str = "") -> UnsafeCheckpointError:
    """The one-line error for a pickle that asked for a class outside the allow-list."""
    text = str(err)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"asks for (\S+)", text)
    if found:
        # torch names builtins without their module ("GLOBAL eval").
        detail = "it asks for " + (found[1] if "." in found[1] else f"builtins.{found[1]}")
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        detail = next((line for line in lines if "WeightsUnpickler" in line), lines[0])
    return UnsafeCheckpointError(
        f"{path}{what}: refused to unpickle ({detail}); this file holds code, not just weights. "
        "Convert it to .safetensors, or pass --unsafe-load if you trust its source."
    )


def _unreadable(path, err: Exception) -> ValueError:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), repr(err))
    return ValueError(f"{path}: not a readable checkpoint ({first}); is the file complete?")


def _weights_only_load(source, path, extra_globals: Iterable = (), what: str = "", **kwargs):
    """torch.load(weights_only=True) with the allow-list; refusals and damage name `path`."""
    try:
        with torch.serialization.safe_globals([*_allowed_globals(), *extra_globals]):
            return torch.load(source, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise _refusal(path, err, what) from None
    except (RuntimeError, EOFError, KeyError, zipfile.BadZipFile) as err:
        # A truncated or foreign file: torch says "failed finding central directory",
        # "unexpected EOF" or KeyError(<first byte>), none of which names the file.
        raise _unreadable(path, err) from None


def check_pickle(path: str | Path, extra_globals: Iterable = ()) -> None:
    """Refuse (UnsafeCheckpointError) a torch pickle that needs a class outside the allow-list
    (plus `extra_globals`). Loaded weights-only and dropped, memory-mapped where the format
    allows, so checking a file before a loader that unpickles it fully costs little."""
    path = Path(path)
    if path.suffix != ".safetensors":  # holds no pickle
        _weights_only_load(path, path, extra_globals, mmap=zipfile.is_zipfile(path))


def load_file_state(
    path: str | Path, unsafe: bool = False, extra_globals: Iterable = (), mmap: bool = False
) -> dict:
    """The raw contents of a `.safetensors` file or a torch pickle (`.ckpt`, `.pt`, `.bin`).

    Pickles load with `weights_only=True` and a short allow-list (plus `extra_globals`); a
    checkpoint that needs any other class is refused with its name unless `unsafe=True` (only
    for files you trust). A damaged file raises ValueError naming it. `mmap`: the tensors of a
    torch zip file are memory-mapped, read from the file when used.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except SafetensorError as err:  # "incomplete metadata, file not fully covered"
            raise ValueError(f"{path}: not a readable .safetensors file ({err})") from None
    mmap = mmap and zipfile.is_zipfile(path)  # the legacy format cannot be mapped
    if unsafe:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    return _weights_only_load(path, path, extra_globals, mmap=mmap)


# --- torch.distributed.checkpoint folders (sharded FSDP) ------------------------------------
# Their `.metadata` is a plain pickle (protocol 4, which torch's weights-only unpickler cannot
# read) that FileSystemReader loads with `pickle.load`: it is checked by an unpickler that
# resolves only these names. Non-tensor entries of the `*.distcp` files are torch pickles that
# the default load planner reads with `weights_only=False`: each is checked weights-only first.
SHARDED_DTYPES = (
    "bfloat16",
    "bool",
    "complex128",
    "complex64",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int16",
    "int32",
    "int64",
    "int8",
    "uint8",
)


def _sharded_metadata_globals() -> dict[str, object]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    found = {f"torch.{name}": getattr(torch, name) for name in SHARDED_DTYPES}
    found["torch.Size"] = torch.Size
    found["torch.serialization._get_layout"] = torch.serialization._get_layout
    found["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    for name in (
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ):
        found[f"torch.distributed.checkpoint.metadata.{name}"] = getattr(metadata, name)
    # StorageMeta.checkpoint_id: the folder it was written to (pathlib._local from Python 3.13).
    for module in ("pathlib", "pathlib._local"):
        found[f"{module}.PosixPath"] = pathlib.PosixPath
        found[f"{module}.PurePosixPath"] = pathlib.PurePosixPath
    return found


def sharded_metadata_global_names() -> list[str]:
    """What a sharded checkpoint's `.metadata` may ask for (pinned by a test)."""
    return sorted(_sharded_metadata_globals())


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names of `_sharded_metadata_globals`: every class or function a pickle
    can call is looked up here, so nothing else can run (the stdlib's "restricting globals")."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path
        self.allowed = _sharded_metadata_globals()

    def find_class(self, module: str, name: str):
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise _refusal(self.path, ValueError(f"asks for {module}.{name}"))
        return found

    def persistent_load(self, pid):
        raise _refusal(self.path, ValueError(f"asks for persistent id {pid!r}"))


def read_sharded_metadata(path: str | Path):
    """The `Metadata` of a `.metadata` file, unpickled with only its own classes resolvable."""
    path = Path(path)
    with open(path, "rb") as file:
        try:
            return _MetadataUnpickler(file, path).load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise _unreadable(path, err) from None


def check_sharded_folder(folder: str | Path, extra_globals: Iterable = ()) -> None:
    """Refuse (UnsafeCheckpointError) a torch.distributed.checkpoint folder (Lightning's sharded
    FSDP checkpoint) with anything outside the allow-list: its `.metadata` files, the non-tensor
    entries of its shards (tensor entries torch loads weights-only itself), its `*.pt` files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    for meta in sorted(p for p in folder.iterdir() if p.name.endswith(".metadata")):
        metadata = read_sharded_metadata(meta)
        entries = getattr(metadata, "state_dict_metadata", None) or {}
        for index, info in (getattr(metadata, "storage_data", None) or {}).items():
            if not isinstance(entries.get(getattr(index, "fqn", None)), BytesStorageMetadata):
                continue
            shard = folder / info.relative_path
            with open(shard, "rb") as file:
                file.seek(info.offset)
                stream = io.BytesIO(file.read(info.length))
            if info.transform_descriptors:  # e.g. compressed: undone as the reader would
                from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

                stream = io.BytesIO(
                    _StorageReaderTransforms()
                    .transform_load_stream(None, info.transform_descriptors, stream)
                    .read()
                )
            _weights_only_load(stream, shard, extra_globals, what=f" (entry '{index.fqn}')")
    for pt in sorted(folder.glob("*.pt")):
        check_pickle(pt, extra_globals)


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
    """In place: accept both text-encoder forms, drop `position_ids` and sgm's
    `denoiser.sigmas` (constants, not weights)."""
    for name in SGM_CONSTANTS:
        state.pop(prefix + name, None)
    for head in (prefix + CLIP_PREFIX, prefix + SGM_CLIP_PREFIX):
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
    drop_ema_shadows(state, prefix)


def drop_ema_shadows(state: dict, prefix: str = "") -> None:
    """In place: remove the `model_ema.*` shadows, which the EMA callback (or `apply_ema`) reads
    from the checkpoint, not the module."""
    for key in [k for k in state if k.startswith(prefix + EMA_PREFIX)]:
        del state[key]


# --- LoRA: peft's names <-> the original layout --------------------------------------------
def peft_free_name(name: str) -> str:
    """A name without peft's levels: `...to_q.base_layer.weight` -> `...to_q.weight`,
    `...to_q.lora_A.default.weight` -> `...to_q.lora_A.weight`."""
    return PEFT_ADAPTER_LEVEL.sub(r".\1.", name.replace("." + PEFT_BASE_LEVEL, "."))


def is_adapter_name(name: str) -> bool:
    return PEFT_ADAPTER_LEVEL.search(name) is not None


def original_key(name: str) -> str:
    """The checkpoint key of a LoRA model's state-dict entry: base weights under their original
    names, adapter weights apart under `lora.`."""
    return (LORA_PREFIX if is_adapter_name(name) else "") + peft_free_name(name)


def to_original_layout(state: Mapping, backbone_names: Iterable[str] = ()) -> dict:
    """A LoRA model's state dict (peft's names) -> checkpoint keys (`original_key`); the EMA
    shadows of `backbone_names` (names in `LatentDiffusion.model`) lose peft's levels too."""
    renamed = {ema_key(n): ema_key(peft_free_name(n)) for n in backbone_names}
    return {renamed.get(k) or original_key(k): v for k, v in state.items()}


def to_module_layout(
    state: dict, module_keys: Iterable[str], backbone_names: Iterable[str] = ()
) -> None:
    """In place: checkpoint keys -> the module's (peft's) names, the inverse of
    `to_original_layout`. Keys already in the module's form are kept; adapter keys are
    also accepted without the `lora.` level (as `apply_ema` writes them)."""
    names = {}
    for key in module_keys:
        names[original_key(key)] = names[peft_free_name(key)] = key
    names.update({ema_key(peft_free_name(n)): ema_key(n) for n in backbone_names})
    for key in [k for k in state if k in names and names[k] != k]:
        state[names[key]] = state.pop(key)


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
    contents: Mapping | None = None,
    what: str = "",
) -> dict:
    """Load a checkpoint (ours or an original SD one) into a `LatentDiffusion`, strictly.

    Args:
        ema: True: use the EMA shadows (error if absent); None: use them when present; False: never.
        contents: the file's contents when already read (e.g. a merged DeepSpeed folder).
        what: how the user named the file (`--ckpt`, `model.params.ckpt_path`), for messages.
    A file of another family (`ldm.layout.family`) is refused before loading (WrongFileError).
    `path` may also be a diffusers folder, read in the original layout (`ldm.diffusers_layout`).
    Returns the checkpoint's state dict as loaded (for hashing or inspection).
    """
    from ldm import diffusers_layout  # it builds on this module

    expected = model_family_of(model)
    if contents is not None:
        pass
    elif diffusers_layout.is_diffusers_folder(path):
        check_family(path, family.diffusers_family(path), expected, what)
        contents = diffusers_layout.load_folder(model, path, unsafe=unsafe)
    else:
        contents = load_file_state(path, unsafe=unsafe)
    check_family(path, family.model_family(file_state_keys(contents)), expected, what)
    bare = bare_backbone_state(contents, model.backbone, ema)
    if bare is not None:
        result = model.backbone.load_state_dict(bare, strict=False)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise KeyError(mismatch_message(path, result.missing_keys, result.unexpected_keys))
        return bare
    state = state_dict_of(contents)
    use_ema = has_ema(state) if ema is None else ema
    if use_ema and not has_ema(state):
        raise KeyError(f"{path}: asked for EMA weights but the checkpoint has none (model_ema.*)")
    unet_names = [n for n, p in model.model.named_parameters()]
    if any(PEFT_BASE_LEVEL in n for n in unet_names):
        # LoRA: a LoRA run's EMA shadows its adapters only; a base model's, the base weights.
        adapters_in_file = any(k.startswith(LORA_PREFIX) for k in state)
        unet_names = [
            peft_free_name(n) for n in unet_names if is_adapter_name(n) == adapters_in_file
        ]
    else:
        # EMA shadows exist for trained weights only (LitEma's rule): not DiT's fixed pos_embed.
        unet_names = [n for n, p in model.model.named_parameters() if p.requires_grad]
    weights = apply_ema(state, unet_names) if use_ema else without_ema(state)
    from_original_layout(weights)
    result = model.load_state_dict(weights, strict=False)
    missing = result.missing_keys
    if not any(k.startswith(LORA_PREFIX) for k in state):
        # A base model (an original file, a full fine-tune) under fresh adapters.
        missing = [k for k in missing if not is_adapter_name(k)]
    if strict and (missing or result.unexpected_keys):
        raise KeyError(mismatch_message(path, missing, result.unexpected_keys))
    return state


def file_state_keys(contents: Mapping) -> list[str]:
    """The tensor names of a file's contents (a DiT `train.py` checkpoint: its `ema` entry's)."""
    if isinstance(contents.get("ema"), Mapping) and isinstance(contents.get("model"), Mapping):
        contents = contents["ema"]
    return list(state_dict_of(contents))


def bare_backbone_state(
    contents: Mapping, backbone: torch.nn.Module, ema: bool | None
) -> dict | None:
    """The weights of a file holding the backbone alone under its own names, else None.

    That is the released DiT `.pt` (a flat state dict of the EMA weights: `x_embedder.proj.weight`,
    `blocks.0.attn.qkv.weight`, ...) or a DiT `train.py` checkpoint, whose `ema` entry is taken
    (its `model` with ema=False), as DiT's sample.py does. The first stage and the schedule are
    not in such files: they come from the config.
    """
    if isinstance(contents.get("ema"), Mapping) and isinstance(contents.get("model"), Mapping):
        contents = contents["model"] if ema is False else contents["ema"]
    state = {k: v for k, v in contents.items() if isinstance(v, torch.Tensor)}
    own = backbone.state_dict()
    ours = (BACKBONE_PREFIX, FIRST_STAGE_PREFIX, EMA_PREFIX, "cond_stage_model.", "conditioner.")
    if any(k.startswith(ours) for k in state) or not set(state) & set(own):
        return None
    return state


def dit_to_diffusers(state: Mapping) -> dict[str, torch.Tensor]:
    """A DiT state dict (facebookresearch/DiT names, ours) -> diffusers' DiTTransformer2DModel's.

    The renames of diffusers' scripts/convert_dit_to_diffusers.py: the shared timestep and class
    embedders are copied into every block's `norm1.emb`, `qkv` is split into `to_q/to_k/to_v`,
    the final layer becomes `proj_out_1/2`. `pos_embed` is left out: diffusers computes its own
    table. (diffusers' DiT divides the timestep frequencies by half - 1, DiT's code by half: the
    outputs differ slightly unless its `time_proj` uses downscale_freq_shift=0.)
    """
    state = dict(state)
    out = {
        "pos_embed.proj.weight": state.pop("x_embedder.proj.weight"),
        "pos_embed.proj.bias": state.pop("x_embedder.proj.bias"),
        "proj_out_1.weight": state.pop("final_layer.adaLN_modulation.1.weight"),
        "proj_out_1.bias": state.pop("final_layer.adaLN_modulation.1.bias"),
        "proj_out_2.weight": state.pop("final_layer.linear.weight"),
        "proj_out_2.bias": state.pop("final_layer.linear.bias"),
    }
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for i in range(depth):
        new, old = f"transformer_blocks.{i}.", f"blocks.{i}."
        emb = new + "norm1.emb."
        for kind in ("weight", "bias"):
            out[emb + f"timestep_embedder.linear_1.{kind}"] = state[f"t_embedder.mlp.0.{kind}"]
            out[emb + f"timestep_embedder.linear_2.{kind}"] = state[f"t_embedder.mlp.2.{kind}"]
            out[new + f"norm1.linear.{kind}"] = state.pop(old + f"adaLN_modulation.1.{kind}")
            q, k, v = state.pop(old + f"attn.qkv.{kind}").chunk(3, dim=0)
            out.update({new + f"attn1.to_{n}.{kind}": w for n, w in zip("qkv", (q, k, v))})
            out[new + f"attn1.to_out.0.{kind}"] = state.pop(old + f"attn.proj.{kind}")
            out[new + f"ff.net.0.proj.{kind}"] = state.pop(old + f"mlp.fc1.{kind}")
            out[new + f"ff.net.2.{kind}"] = state.pop(old + f"mlp.fc2.{kind}")
        table = state["y_embedder.embedding_table.weight"]
        out[emb + "class_embedder.embedding_table.weight"] = table
    left = sorted(k for k in state if not k.startswith(("t_embedder.", "y_embedder.")))
    if left != ["pos_embed"]:
        raise KeyError(f"not a DiT state dict: {left[:3]} left over")
    return out


def load_first_stage(
    vae: torch.nn.Module, path: str | Path, ignore_keys=(), what: str = ""
) -> None:
    """Load a VAE's weights (strict) from a VAE file or a full SD checkpoint (`first_stage_model.*`).

    Files of the original VAE training also carry `loss.*` (LPIPS, discriminator) and EMA keys;
    only the VAE's own names are taken, and every one of them must be there.
    """
    state = state_dict_of(load_file_state(path))
    found = family.model_family(state)
    if found != family.VAE and not any(k.startswith(FIRST_STAGE_PREFIX) for k in state):
        expected = "a VAE, or a model checkpoint holding one (first_stage_model.*)"
        check_family(path, found, family.VAE, what, expected_text=expected)
    if any(k.startswith(FIRST_STAGE_PREFIX) for k in state):
        state = {
            k.removeprefix(FIRST_STAGE_PREFIX): v
            for k, v in state.items()
            if k.startswith(FIRST_STAGE_PREFIX)
        }
    if diffusers_vae.is_diffusers_vae(state):
        state = diffusers_vae.from_diffusers(state)
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
    for key, value in state.items():
        if value.shape != own[key].shape:
            raise ValueError(
                f"{path}: {key} is {tuple(value.shape)}, this ddconfig's is {tuple(own[key].shape)}"
            )
    vae.load_state_dict(state, strict=True)


def mismatch_message(path, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{path} does not match the model config"]
    if missing:
        parts.append(f"{len(missing)} missing keys, first: {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys, first: {', '.join(unexpected[:3])}")
    return "; ".join(parts) + " (is --config the right one for this checkpoint?)"


# safetensors' names of torch dtypes (its format: an 8-byte little-endian header length, a JSON
# header of dtype, shape and byte offsets per tensor, then the tensors' bytes back to back).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def save_safetensors(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    keep: Collection[str] = (),
) -> None:
    """Write a flat state dict as .safetensors, atomically and one tensor at a time; floating
    tensors cast to `dtype` when given, except the names in `keep`.

    safetensors' own `save_file` turns every tensor into a bytes copy first - a second full copy
    of a 4 GB model in memory. Here each tensor is cast, written and dropped before the next, so a
    file of any size needs one tensor of memory; tensors of a memory-mapped checkpoint are read
    straight from their file.
    """

    def dtype_of(name: str, tensor: torch.Tensor) -> torch.dtype:
        cast = dtype is not None and tensor.is_floating_point() and name not in keep
        return dtype if cast else tensor.dtype

    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in state.items():
        size = tensor.numel() * torch.empty((), dtype=dtype_of(name, tensor)).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype_of(name, tensor)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as save_file does
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as file:
            file.write(struct.pack("<Q", len(encoded)) + encoded)
            for name, tensor in state.items():
                tensor = tensor.detach().to("cpu", dtype_of(name, tensor)).contiguous()
                file.write(tensor.reshape(-1).view(torch.uint8).numpy())  # no bytes copy
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_hash(path: str | Path) -> str:
    """First 10 hex digits of the file's SHA-256 (the AUTOMATIC1111 'Model hash'); of a
    diffusers folder, its UNet's weights files."""
    from ldm import diffusers_layout

    files = [path]
    if diffusers_layout.is_diffusers_folder(path):
        files = diffusers_layout.weights_files(Path(path) / "unet")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:10]
