"""Weights into a model and out to files: the family check, loading a checkpoint (ours, an
original SD one, a diffusers folder, a DiT file) into a `LatentDiffusion` or a VAE, strictly, and
writing `.safetensors`.

Files are read by `ldm.safe_load` (safetensors, pickles with an allow-list); which names a file
holds and how they map to ours is asked of `ldm.layout` (no prefix is spelled here).
"""

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from ldm.layout import diffusers, diffusers_vae, dit, family, original, peft
from ldm.layout.ema import EMA_PREFIX, apply_ema, drop_ema_shadows, has_ema, without_ema
from ldm.safe_load import load_file_state, state_dict_of


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


# The weights files a model config may name (model.params...), checked before anything is built.
CONFIG_FILES = ("ckpt_path", "first_stage_config.params.ckpt_path")


def check_config_files(
    model_config: Mapping, resume=None, unsafe: bool = False, resume_flag: str = "--resume"
) -> None:
    """The weights files a model config names (and `--resume`'s checkpoint), before anything
    is built: one that is not there, or of another family than the config's model, is a
    WrongFileError naming the key (a mistyped `model.params.ckpt_path` would otherwise end in a
    traceback after building, an SDXL file for an SD config in a size-mismatch dump)."""
    given = {}  # key -> the path it names
    for key in CONFIG_FILES:
        value = model_config.get("params") or {}
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        given[key] = value
        if value and not Path(value).exists():
            raise WrongFileError(f"model.params.{key}: {value}: no such file")
        # A folder is a model only as a diffusers pipeline (`load_weights` reads those).
        if value and Path(value).is_dir():
            if key == "ckpt_path" and diffusers.is_diffusers_folder(value):
                check_diffusers_parts(Path(value))
                continue
            also = " or a diffusers folder (model_index.json)" if key == "ckpt_path" else ""
            raise WrongFileError(
                f"model.params.{key}: {value} is a folder; expected a weights file "
                f"(.safetensors / .ckpt){also}"
            )
    vae_key = "first_stage_config.params.ckpt_path"
    if given[vae_key]:  # a file: a folder was refused above
        check_vae_file(given[vae_key], f"model.params.{vae_key}", unsafe)
    named = {"model.params.ckpt_path": given["ckpt_path"], resume_flag: resume}
    named = {what: path for what, path in named.items() if path}
    if not named:
        return
    expected = family.model_family(model_config)
    for what, path in named.items():
        found = family.file_family(path, unsafe)
        if expected == family.VAE and found != family.LORA and what != resume_flag:
            continue  # a VAE run starts from a VAE or from any model's first_stage_model.*
        check_family(path, found, expected, what)


def check_diffusers_parts(folder: Path) -> None:
    """A diffusers folder's configs and the weights file of each part it needs, without reading
    a tensor (a missing `vae/` or `unet/config.json` was found when the model was built)."""
    try:
        info = diffusers.describe(folder)
        for part in ("unet", "vae", *diffusers.TEXT_FOLDERS[info.family]):
            diffusers.weights_files(folder / part)
    except diffusers.DiffusersFolderError as err:
        raise WrongFileError(f"model.params.ckpt_path: {err}") from None


VAE_EXPECTED = f"a VAE, or a model checkpoint holding one ({original.FIRST_STAGE_PREFIX}*)"


def check_vae_file(path, what: str = "", unsafe: bool = False) -> None:
    """A first stage's weights file, read from its key names before anything is built (a
    damaged file, a LoRA or a DiT file were found only when the model was built, after the data
    was indexed): a VAE file, or any model checkpoint holding `first_stage_model.*`."""
    keys = family.file_keys(path, unsafe)
    found = family.model_family(keys)
    if found != family.VAE and not original.has_first_stage(keys):
        check_family(path, found, family.VAE, what, expected_text=VAE_EXPECTED)


def load_state_dict_pre_hook(module, state: dict, prefix: str, *args) -> None:
    """`LatentDiffusion`'s load hook: original files load strictly (both text-encoder forms,
    no `position_ids`), and the EMA shadows are left to their owner (the EMA callback, or
    `apply_ema`). It only drops or adds the level of keys the module has, so it never collides
    with the hooks of FSDP or DeepSpeed; nothing is renamed on save."""
    original.from_original_layout(state, prefix)
    drop_ema_shadows(state, prefix)


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
    `path` may also be a diffusers folder, read in the original layout (`ldm.layout.diffusers`).
    Returns the checkpoint's state dict as loaded (for hashing or inspection).
    """
    expected = family.model_family(model)
    if contents is not None:
        pass
    elif diffusers.is_diffusers_folder(path):
        check_family(path, family.diffusers_family(path), expected, what)
        contents = load_diffusers_folder(model, path, unsafe=unsafe)
    else:
        contents = load_file_state(path, unsafe=unsafe)
    check_family(path, family.model_family(dit.file_state_keys(contents)), expected, what)
    bare = dit.bare_backbone_state(contents, model.backbone, ema)
    if bare is not None:
        result = model.backbone.load_state_dict(bare, strict=False)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise KeyError(mismatch_message(path, result.missing_keys, result.unexpected_keys))
        return bare
    state = state_dict_of(contents)
    use_ema = has_ema(state) if ema is None else ema
    if use_ema and not has_ema(state):
        raise KeyError(f"{path}: asked for EMA weights but the checkpoint has none ({EMA_PREFIX}*)")
    unet_names = peft.ema_shadowed(model.model.named_parameters(), state)
    weights = apply_ema(state, unet_names) if use_ema else without_ema(state)
    original.from_original_layout(weights)
    result = model.load_state_dict(weights, strict=False)
    missing = peft.missing_after_load(result.missing_keys, state)
    if strict and (missing or result.unexpected_keys):
        raise KeyError(mismatch_message(path, missing, result.unexpected_keys))
    return state


def use_folder_tokenizers(model: torch.nn.Module, info: diffusers.FolderInfo) -> None:
    """The text towers tokenize with the folder's `tokenizer/` (and `tokenizer_2/`) vocabulary
    and merges, in the order of the towers (`text_encoder`, `text_encoder_2`)."""
    from ldm.text_encoder import clip_tokenizer

    towers = [m for m in model.modules() if hasattr(m, "tokenizer") and hasattr(m, "tokenize")]
    for tower, folder in zip(towers, info.tokenizers):
        if folder is not None:
            tower.tokenizer = clip_tokenizer(str(folder))


def load_diffusers_folder(model: torch.nn.Module, folder, unsafe: bool = False) -> dict:
    """The original-layout state dict of `folder`, checked against `model` and completed; the
    model's tokenizers switched to the folder's."""
    folder = Path(folder)
    state, info = diffusers.original_state(folder, unsafe)
    diffusers.check_model(model, folder, info, state)
    use_folder_tokenizers(model, info)
    return state


def load_first_stage(
    vae: torch.nn.Module, path: str | Path, ignore_keys=(), what: str = ""
) -> None:
    """Load a VAE's weights (strict) from a VAE file or a full SD checkpoint (`first_stage_model.*`).

    Files of the original VAE training also carry `loss.*` (LPIPS, discriminator) and EMA keys;
    only the VAE's own names are taken, and every one of them must be there.
    """
    state = state_dict_of(load_file_state(path))
    found = family.model_family(state)
    if found != family.VAE and not original.has_first_stage(state):
        check_family(path, found, family.VAE, what, expected_text=VAE_EXPECTED)
    state = original.first_stage_state(state)
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
    tmp = temporary_path(path)
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


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: hidden, and unique to this
    writer (`x.safetensors.tmp` would replace a user's own file of that name, and two writers
    of one path would share it). `lun.atomic_io` writes checkpoints under these names too and
    recognises a run folder's stale ones by them."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def file_hash(path: str | Path) -> str:
    """First 10 hex digits of the file's SHA-256 (the AUTOMATIC1111 'Model hash'); of a
    diffusers folder, its UNet's weights files."""
    files = [path]
    if diffusers.is_diffusers_folder(path):
        files = diffusers.weights_files(Path(path) / "unet")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:10]
