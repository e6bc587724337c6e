"""Diffusers pipeline folders -> the original single-file layout: the inverse of `--to-diffusers`.

A diffusers folder (`model_index.json` with `unet/`, `vae/`, `text_encoder/` (+ `text_encoder_2/`
for SDXL), `tokenizer/`, `scheduler/`), or the bare component folders, is read as if it were an
original checkpoint: its tensors are renamed to the CompVis / sgm names here, so the rest of the
code only ever sees the original layout. The rules invert diffusers' own single-file converters
(`diffusers.loaders.single_file_utils`: `convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`,
`convert_ldm_clip_checkpoint`, `convert_open_clip_checkpoint`); the tests check them against
those converters run the other way.

- UNet: block-indexed diffusers names (`down_blocks.b.resnets.l`) -> the flat `input_blocks.i.j`
  of the original, from the unet config (levels, `layers_per_block`, which levels attend).
- VAE: `down_blocks` / `up_blocks` (the decoder's in reverse order) -> `down.i` / `up.i`; the
  mid-block attention's linear q/k/v/out -> the original 1x1 convolutions.
- CLIP (SD 1.x, SDXL's first tower): the transformers names under the `text_model.` level.
- OpenCLIP (SD 2.x, SDXL's second tower): stored by diffusers as a transformers CLIP with
  separate q/k/v; merged back into OpenCLIP's packed `in_proj`, `text_projection` transposed.
  What diffusers does not store is filled (`fill_unstored`).
- Family, prediction type, latent scale and noise schedule come from the folder's configs and
  must agree with the model the user's YAML builds.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ldm.layout import diffusers_vae
from ldm.layout import family as family_rules
from ldm.layout.original import (
    CLIP_LEVEL,
    FIRST_STAGE_PREFIX,
    OPENCLIP_BLOCKS,
    TEXT_PREFIXES,
    UNET_PREFIX,
)
from ldm.safe_load import load_file_state, state_dict_of
from ldm.schedule import schedule_betas, schedule_buffers

FAMILY_NAMES = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL"}
TEXT_FOLDERS = {"sd1": ("text_encoder",), "sd2": ("text_encoder",)}
TEXT_FOLDERS["sdxl"] = ("text_encoder", "text_encoder_2")
TOKENIZER_FOLDERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
WEIGHT_NAMES = (
    "diffusion_pytorch_model",
    "model",
    "pytorch_model",
)  # pytorch_model: older transformers
# diffusers' beta_schedule names -> ours (ldm.schedule.make_betas)
BETA_SCHEDULES = {"scaled_linear": "linear", "linear": "sqrt_linear", "squaredcos_cap_v2": "cosine"}
PREDICTION_TYPES = {"epsilon": "eps", "v_prediction": "v"}
# OpenCLIP's initial logit scale (log 1/0.07); diffusers keeps no logit_scale and it is never used
# for conditioning.
OPEN_CLIP_LOGIT_SCALE = math.log(1 / 0.07)


class DiffusersFolderError(ValueError):
    """A diffusers folder that cannot be read as an original checkpoint; names the file."""


def is_diffusers_folder(path) -> bool:
    """A pipeline folder (`model_index.json`) or a bare set of component folders (`unet/`)."""
    path = Path(path)
    return path.is_dir() and ((path / "model_index.json").is_file() or (path / "unet").is_dir())


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DiffusersFolderError(f"{path}: missing (is the diffusers folder complete?)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DiffusersFolderError(f"{path}: not valid JSON ({err})") from None


@dataclass
class FolderInfo:
    """What a folder's configs say about the model its weights belong to."""

    family: str  # "sd1" | "sd2" | "sdxl"
    reason: str  # the config value that told the family, for error messages
    parameterization: str | None  # "eps" | "v" (None: no scheduler config)
    scale_factor: float | None
    schedule: dict | None  # arguments of ldm.schedule.schedule_betas
    tokenizers: list[Path | None] = field(default_factory=list)  # per text tower


def describe(folder: Path) -> FolderInfo:
    """Family, prediction type, latent scale and schedule from the folder's config files."""
    unet_file = folder / "unet" / "config.json"
    unet = read_json(unet_file)
    text_file = folder / "text_encoder" / "config.json"
    text = read_json(text_file)
    hidden_act = text.get("hidden_act", family_rules.DEFAULT_CLIP_ACTIVATION)
    clip = family_rules.CLIP_ACTIVATIONS.get(hidden_act)  # (family, which CLIP) or None
    if family_rules.is_sdxl(unet):
        family, reason = "sdxl", f"{unet_file}: addition_embed_type text_time"
    elif unet.get("addition_embed_type") or unet.get("class_embed_type"):
        raise DiffusersFolderError(
            f"{unet_file}: unknown model family (addition_embed_type "
            f"{unet.get('addition_embed_type')!r}, class_embed_type "
            f"{unet.get('class_embed_type')!r}); SD 1.x, SD 2.x and SDXL folders are supported"
        )
    elif clip is not None:
        family = {family_rules.SD1: "sd1", family_rules.SD2: "sd2"}[clip[0]]
        reason = f"{text_file}: hidden_act {hidden_act} ({clip[1]})"
    else:
        raise DiffusersFolderError(
            f"{text_file}: unknown model family (hidden_act {hidden_act!r}); "
            "SD 1.x, SD 2.x and SDXL folders are supported"
        )
    vae = read_json(folder / "vae" / "config.json")
    parameterization = schedule = None
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    if scheduler_file.is_file():
        parameterization, schedule = read_scheduler(scheduler_file)
    tokenizers = []
    for name in TEXT_FOLDERS[family]:
        tokenizer = folder / TOKENIZER_FOLDERS[name]
        tokenizers.append(tokenizer if tokenizer.is_dir() else None)
    return FolderInfo(
        family, reason, parameterization, vae.get("scaling_factor"), schedule, tokenizers
    )


def read_scheduler(path: Path) -> tuple[str, dict]:
    """(parameterization, schedule_betas arguments) of a diffusers scheduler config."""
    config = read_json(path)
    prediction = config.get("prediction_type", "epsilon")
    if prediction not in PREDICTION_TYPES:
        raise DiffusersFolderError(
            f"{path}: prediction_type {prediction!r} is not one of {sorted(PREDICTION_TYPES)}"
        )
    beta_schedule = config.get("beta_schedule", "linear")
    if beta_schedule not in BETA_SCHEDULES or config.get("trained_betas") is not None:
        raise DiffusersFolderError(
            f"{path}: beta_schedule {beta_schedule!r} (or trained_betas) is not supported; "
            f"expected one of {sorted(BETA_SCHEDULES)}"
        )
    schedule = {
        "timesteps": config.get("num_train_timesteps", 1000),
        "beta_schedule": BETA_SCHEDULES[beta_schedule],
        "linear_start": config.get("beta_start", 0.0001),
        "linear_end": config.get("beta_end", 0.02),
        "zero_terminal_snr": bool(config.get("rescale_betas_zero_snr", False)),
    }
    return PREDICTION_TYPES[prediction], schedule


# --- weights files --------------------------------------------------------------------------
def weights_files(component: Path) -> list[Path]:
    """The weights files of one component folder: `.safetensors` first (sharded through its
    index), else `.bin`; the variant-free name before `fp16` / `ema` variants."""
    if not component.is_dir():
        raise DiffusersFolderError(f"{component}: missing (is the diffusers folder complete?)")
    for suffix in (".safetensors", ".bin"):
        for name in WEIGHT_NAMES:
            index = component / f"{name}{suffix}.index.json"
            if index.is_file():
                shards = sorted(set(read_json(index).get("weight_map", {}).values()))
                return [component / shard for shard in shards]
            if (component / f"{name}{suffix}").is_file():
                return [component / f"{name}{suffix}"]
        # A variant (`diffusion_pytorch_model.fp16.safetensors`), sharded or not.
        for index in sorted(component.glob(f"*{suffix}.index.*json")):
            return [
                component / shard for shard in sorted(set(read_json(index)["weight_map"].values()))
            ]
        variants = sorted(
            p for p in component.glob(f"*{suffix}") if p.name.startswith(WEIGHT_NAMES)
        )
        if len(variants) == 1:
            return variants
        if variants:
            raise DiffusersFolderError(
                f"{component}: several weights files ({', '.join(p.name for p in variants)}); "
                "keep one variant"
            )
    raise DiffusersFolderError(
        f"{component}: no weights file (diffusion_pytorch_model.safetensors or model.safetensors)"
    )


def load_component(component: Path, unsafe: bool = False) -> dict[str, torch.Tensor]:
    """A component's tensors; `.bin` pickles load weights-only (refusals name the file)."""
    state = {}
    for path in weights_files(component):
        state.update(state_dict_of(load_file_state(path, unsafe=unsafe)))
    return state


# --- UNet -----------------------------------------------------------------------------------
UNET_TOP = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",  # SDXL's `vector` (pooled text + sizes)
    "add_embedding.linear_2.": "label_emb.0.2.",
}
RESNET_NAMES = {
    "norm1.": "in_layers.0.",
    "conv1.": "in_layers.2.",
    "time_emb_proj.": "emb_layers.1.",
    "norm2.": "out_layers.0.",
    "conv2.": "out_layers.3.",
    "conv_shortcut.": "skip_connection.",
}


def unet_block_map(config: dict) -> dict[str, str]:
    """diffusers block prefix -> original block prefix, from the UNet's config.

    The original UNet numbers its blocks in one flat list: `input_blocks` are conv_in, then per
    level `layers_per_block` (resnet, attention?) pairs and a downsampler; `output_blocks` have
    one layer more per level, the upsampler after the attention (`.2`) or the resnet (`.1`)."""
    levels = len(config["block_out_channels"])
    per = config["layers_per_block"]
    attends = ["CrossAttn" in t for t in config["down_block_types"]]
    up_attends = ["CrossAttn" in t for t in config["up_block_types"]]
    blocks = {}
    for b in range(levels):
        for layer in range(per):
            i = 1 + b * (per + 1) + layer
            blocks[f"down_blocks.{b}.resnets.{layer}."] = f"input_blocks.{i}.0."
            if attends[b]:
                blocks[f"down_blocks.{b}.attentions.{layer}."] = f"input_blocks.{i}.1."
        if b < levels - 1:
            blocks[f"down_blocks.{b}.downsamplers.0.conv."] = (
                f"input_blocks.{1 + b * (per + 1) + per}.0.op."
            )
        for layer in range(per + 1):
            i = b * (per + 1) + layer
            blocks[f"up_blocks.{b}.resnets.{layer}."] = f"output_blocks.{i}.0."
            if up_attends[b]:
                blocks[f"up_blocks.{b}.attentions.{layer}."] = f"output_blocks.{i}.1."
        if b < levels - 1:
            last = b * (per + 1) + per
            blocks[f"up_blocks.{b}.upsamplers.0.conv."] = (
                f"output_blocks.{last}.{2 if up_attends[b] else 1}.conv."
            )
    blocks["mid_block.resnets.0."] = "middle_block.0."
    blocks["mid_block.attentions.0."] = "middle_block.1."
    blocks["mid_block.resnets.1."] = "middle_block.2."
    return blocks


def _renamed(key: str, table: dict[str, str]) -> str | None:
    """`key` with the first matching prefix of `table` replaced, else None."""
    for old, new in table.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def unet_to_original(state: dict, config: dict, source: Path) -> dict:
    blocks = unet_block_map(config)
    out = {}
    for key, value in state.items():
        name = _renamed(key, UNET_TOP)
        if name is None:
            prefix = next((old for old in blocks if key.startswith(old)), None)
            if prefix is None:
                raise DiffusersFolderError(f"{source}: unexpected UNet key {key}")
            # Resnets rename their layers; attentions keep diffusers' names (the original's).
            inner = key[len(prefix) :]
            if ".resnets." in prefix:
                inner = _renamed(inner, RESNET_NAMES) or inner
            name = blocks[prefix] + inner
        out[UNET_PREFIX + name] = value
    return out


# --- VAE ------------------------------------------------------------------------------------
def vae_to_original(state: dict, source: Path) -> dict:
    """The VAE's names are ldm.layout.diffusers_vae's rules (shared with --vae and swap_vae)."""
    try:
        bare = diffusers_vae.from_diffusers(state)
    except KeyError as err:
        raise DiffusersFolderError(f"{source}: {err.args[0]}") from None
    return {FIRST_STAGE_PREFIX + name: value for name, value in bare.items()}


# --- text towers ----------------------------------------------------------------------------
def clip_to_original(state: dict, prefix: str) -> dict:
    """transformers CLIPTextModel names (with or without the `text_model.` level) -> `prefix` +
    `text_model.*`; `position_ids` (a constant) dropped."""
    return {
        prefix + CLIP_LEVEL + k.removeprefix(CLIP_LEVEL): v
        for k, v in state.items()
        if not k.endswith("position_ids")
    }


OPEN_CLIP_TOP = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}
OPEN_CLIP_LAYER = {
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "self_attn.out_proj.": "attn.out_proj.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
}


def open_clip_to_original(state: dict, prefix: str, source: Path) -> dict:
    """A transformers CLIPTextModel(WithProjection) holding an OpenCLIP tower -> OpenCLIP names:
    q/k/v concatenated into `attn.in_proj_*` (nn.MultiheadAttention packs them in that order),
    `text_projection.weight` transposed (OpenCLIP computes `x @ P`, a Linear `x @ W.T`)."""
    state = {k.removeprefix(CLIP_LEVEL): v for k, v in state.items()}
    out = {}
    for key, value in state.items():
        if key in OPEN_CLIP_TOP:
            out[prefix + OPEN_CLIP_TOP[key]] = value
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T.contiguous()
        elif key.startswith("encoder.layers."):
            layer, rest = key.removeprefix("encoder.layers.").split(".", 1)
            block = f"{prefix}{OPENCLIP_BLOCKS}{layer}."
            if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
                if rest.startswith("self_attn.q_proj."):
                    kind = rest.rsplit(".", 1)[1]  # weight | bias
                    parts = [f"encoder.layers.{layer}.self_attn.{n}_proj.{kind}" for n in "qkv"]
                    out[block + f"attn.in_proj_{kind}"] = torch.cat([state[p] for p in parts])
                continue
            renamed = _renamed(rest, OPEN_CLIP_LAYER)
            if renamed is None:
                raise DiffusersFolderError(f"{source}: unexpected text encoder key {key}")
            out[block + renamed] = value
        elif not key.endswith("position_ids"):
            raise DiffusersFolderError(f"{source}: unexpected text encoder key {key}")
    return out


def fill_unstored(state: dict, expected: dict[str, torch.Size]) -> list[str]:
    """In place: add the OpenCLIP keys a diffusers folder cannot hold; returns their names.

    - The last block(s) of the tower: diffusers' SD 2 text encoder stops at the penultimate block,
      whose output (through `ln_final`) is SD 2's conditioning. They are written as zeros: a
      pre-LayerNorm residual block with zero weights returns its input, so the tower's output is
      the same with or without them, for `layer: penultimate` and `last` alike.
    - `text_projection` (SD 2: a plain CLIPTextModel has none; SD 2 does not use it): zeros.
    - `logit_scale` (never stored by diffusers; used by CLIP's contrastive loss only): OpenCLIP's
      initial value log(1 / 0.07).
    """
    filled = []
    for prefix in TEXT_PREFIXES["sd2"] + TEXT_PREFIXES["sdxl"][1:]:
        if not any(k.startswith(prefix) for k in state):
            continue
        for key, shape in expected.items():
            if not key.startswith(prefix) or key in state:
                continue
            rest = key[len(prefix) :]
            if rest == "logit_scale":
                state[key] = torch.full(shape, OPEN_CLIP_LOGIT_SCALE)
            elif rest == "text_projection" or rest.startswith(OPENCLIP_BLOCKS):
                state[key] = torch.zeros(shape)
            else:
                continue
            filled.append(key)
    return filled


# --- the whole folder -----------------------------------------------------------------------
def original_state(folder: Path, unsafe: bool = False) -> tuple[dict, FolderInfo]:
    """The folder's weights in the original layout (schedule buffers for SD 1.x / 2.x, whose
    original files carry them), and what its configs say."""
    folder = Path(folder)
    info = describe(folder)
    unet_config = read_json(folder / "unet" / "config.json")
    state = unet_to_original(load_component(folder / "unet", unsafe), unet_config, folder / "unet")
    read_json(folder / "vae" / "config.json")  # names a missing config
    state.update(vae_to_original(load_component(folder / "vae", unsafe), folder / "vae"))
    for name, prefix in zip(TEXT_FOLDERS[info.family], TEXT_PREFIXES[info.family]):
        read_json(folder / name / "config.json")  # names a missing tower
        weights = load_component(folder / name, unsafe)
        if prefix.endswith(".transformer."):
            state.update(clip_to_original(weights, prefix))
        else:
            state.update(open_clip_to_original(weights, prefix, folder / name))
    if info.family != "sdxl" and info.schedule is not None:
        # sgm's SDXL files carry no schedule buffers; the CompVis ones do.
        state.update(schedule_buffers(schedule_betas(**info.schedule)))
    return state, info


def _built_family(state) -> str:
    found = family_rules.model_family(state)
    return found if found in FAMILY_NAMES.values() else "a model with no SD text encoder"


def check_model(model: torch.nn.Module, folder: Path, info: FolderInfo, state: dict) -> None:
    """The folder must be what the YAML builds: family, prediction type, latent scale, schedule
    and every tensor's shape; each mismatch is one line naming the folder's file."""
    own = model.state_dict()
    family = FAMILY_NAMES[info.family]
    if not any(k.startswith(TEXT_PREFIXES[info.family][-1]) for k in own):
        raise DiffusersFolderError(
            f"{folder} is an {family} pipeline ({info.reason}) but the config builds "
            f"{_built_family(own)} (is --config right?)"
        )
    scheduler = folder / "scheduler" / "scheduler_config.json"
    if info.parameterization is not None and info.parameterization != model.parameterization:
        raise DiffusersFolderError(
            f"{scheduler}: prediction_type is {info.parameterization} but the config has "
            f"parameterization: {model.parameterization}"
        )
    scale = getattr(model, "scale_factor", None)
    if info.scale_factor is not None and scale is not None:
        if not math.isclose(info.scale_factor, scale, rel_tol=1e-6):
            raise DiffusersFolderError(
                f"{folder / 'vae' / 'config.json'}: scaling_factor {info.scale_factor} but the "
                f"config has scale_factor: {scale}"
            )
    betas = own.get("betas")
    if info.schedule is not None and betas is not None and not betas.is_meta:
        theirs = schedule_betas(**info.schedule).to(betas.dtype)
        if theirs.shape != betas.shape or not torch.allclose(theirs, betas, rtol=1e-5, atol=0):
            raise DiffusersFolderError(
                f"{scheduler}: its noise schedule ({info.schedule}) differs from the config's"
            )
    fill_unstored(state, {k: v.shape for k, v in own.items()})
    for key, value in state.items():
        if key in own and own[key].shape != value.shape:
            raise DiffusersFolderError(
                f"{folder}: {key} has shape {list(value.shape)}, the config builds "
                f"{list(own[key].shape)} (is --config right?)"
            )
