"""Which model family or kind a weights file holds, from its key names alone.

Every loader and script asks `model_family` (of a file's keys or state dict, of a built model,
or of the model config that builds it) before loading, so a file of another family or kind is one sentence naming both, not a
size-mismatch dump. The families, by the keys that only they have (`shared/reference/`):

- SD 3 / 3.5: `joint_blocks.*` (MMDiT, bare or under the backbone prefix) or `text_encoders.*`
  (`ldm.layout.sd3`) - checked before DiT, whose `x_embedder.*` an MMDiT shares.
- DiT: `x_embedder.*` / `t_embedder.*` (facebookresearch/DiT), bare or under the backbone's
  `model.diffusion_model.` - checked first: a text DiT also has a text encoder.
- SDXL: `conditioner.embedders.*` (sgm's conditioner: CLIP-L + OpenCLIP bigG).
- SD 2.x: `cond_stage_model.model.*` (OpenCLIP ViT-H text tower).
- SD 1.x: `cond_stage_model.transformer.*` (OpenAI CLIP ViT-L).
- VAE: `encoder.*` / `decoder.*` with no backbone - a VAE file, a VAE training run's checkpoint
  (`loss.*` too) or diffusers' AutoencoderKL names.
- LoRA file: only adapter keys (kohya `lora_unet_*` / `lora_te*_`, `*.lora_down/up`,
  diffusers/peft `*.lora_A/B`, `*.alpha`, DoRA scales). A LoRA *run's* checkpoint is its base
  family: its adapters sit beside the base weights under `lora.`.
- A diffusers folder (`model_index.json`): the family of its pipeline class.

Nothing here loads a tensor: `.safetensors` headers are read with `safe_open`, pickles are
loaded memory-mapped with the safe loader (`ldm.safe_load`).
"""

import copy
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from ldm.layout import flux, original, peft, sd3
from ldm.layout.dit import DIT_KEYS, file_state_keys

SD1, SD2, SDXL, DIT, VAE, LORA = "SD 1.x", "SD 2.x", "SDXL", "DiT", "VAE", "LoRA"
SD3 = "SD 3"  # SD 3 / 3.5 (MMDiT): ldm.layout.sd3's keys
FLUX = "Flux.1"  # dev / schnell (BFL names, ldm.layout.flux); ComfyUI's files share SD3's text_encoders.

_TEXT_ENCODERS = (
    (original.SGM_EMBEDDERS, SDXL),
    (original.OPENCLIP_PREFIX, SD2),
    (original.CLIP_PREFIX, SD1),
)
_VAE_KEYS = ("encoder.", "decoder.", original.FIRST_STAGE_PREFIX)
# A diffusers folder's text_encoder/config.json tells SD 1.x from SD 2.x by the activation:
# OpenAI's CLIP (quick_gelu, transformers' CLIPTextConfig default) or OpenCLIP ViT-H (gelu).
CLIP_ACTIVATIONS = {"quick_gelu": (SD1, "OpenAI CLIP"), "gelu": (SD2, "OpenCLIP")}
DEFAULT_CLIP_ACTIVATION = "quick_gelu"
_ADAPTER_KEY = re.compile(
    r"^lora_(unet|te\d?)_"  # kohya / A1111 / ComfyUI
    r"|(^|\.)(lora_[AB]|lora_down|lora_up|lora\.(down|up)|lora_magnitude_vector|dora_scale|alpha"
    r"|hada_w\d_[ab]|lokr_w\d)(\.|$)"
)
# What a user does with a file of each kind (the second half of the one-line message).
USE = {
    VAE: "a VAE goes to --vae, or to first_stage_config.params.ckpt_path",
    LORA: "a LoRA file goes to --lora, on the model it was trained for",
}


def model_family(source) -> str | None:
    """The family (SD1, SD2, SDXL, DIT, VAE, LORA) of `source`, or None when it matches none (a
    bare UNet, another architecture): callers then load strictly. `source`: state-dict keys (or
    a state dict), a built model (its own checkpoint keys), or a model config
    (`{"target", "params"}`: the model it builds, built on the meta device - names and shapes,
    no memory, no weights loaded)."""
    if isinstance(source, Mapping) and "target" in source:
        return _config_family(source)
    if hasattr(source, "state_dict"):
        source = source.state_dict()
    # a model (or a raw state dict) with LoRA layers: its frozen weights under their own names
    # (`qkv.weight`, not peft's `qkv.base_layer.weight`), as its checkpoint holds them
    keys = [peft.without_base_level(k) for k in source]
    if keys and all(_ADAPTER_KEY.search(k) for k in keys):
        return LORA
    if flux.is_flux(dict.fromkeys(keys)):  # before SD3: both use text_encoders.*
        return FLUX
    if sd3.is_sd3(keys):  # before DiT: an MMDiT has x_embedder / t_embedder too
        return SD3
    if any(k.removeprefix(original.UNET_PREFIX).startswith(DIT_KEYS) for k in keys):
        return DIT
    for prefix, family in _TEXT_ENCODERS:
        if any(k.startswith(prefix) for k in keys):
            return family
    has_backbone = any(k.startswith(original.UNET_PREFIX) for k in keys)
    if not has_backbone and any(k.startswith(_VAE_KEYS) for k in keys):
        return VAE
    return None


# --- which model a LoRA file is for, from its layer names (a LoRA file has no base weights) -------
SD1_OR_2 = "SD 1.x/2.x"  # same layer names (kohya names SD 2.x's OpenCLIP by HF CLIP's)
SD3_OR_FLUX = "SD 3 or Flux.1"  # diffusers' names of double blocks alone: both have them
_LORA_FAMILIES = (  # first match wins: Flux's / SD 3's kohya files have lora_te1_ too
    # kohya-ss (flux_train_network / sd3_train_network: their own block names under lora_unet_)
    (FLUX, re.compile(r"^lora_unet_(double|single)_blocks_")),
    (SD3, re.compile(r"^lora_unet_joint_blocks_")),
    # diffusers' transformer: Flux's single blocks, SD 3.5 Medium's second attention (MMDiT-X)
    (FLUX, re.compile(r"^transformer\.single_transformer_blocks\.")),
    (SD3, re.compile(r"^transformer\.transformer_blocks\.\d+\.attn2\.")),
    (SD3_OR_FLUX, re.compile(r"^transformer\.transformer_blocks\.")),
    # SDXL: kohya's sgm names, its two text encoders, or - diffusers' names, in kohya form or not
    # - a second transformer block in an attention (SDXL has 2 or 10, SD 1.x/2.x one)
    (SDXL, re.compile(r"^lora_unet_(input_blocks|middle_block|output_blocks)_|^lora_te[12]_")),
    (SDXL, re.compile(r"^text_encoder_2\.|transformer_blocks[._][1-9]")),
    (SD1_OR_2, re.compile(r"^lora_unet_|^lora_te_|^unet\.|^text_encoder\.")),
)


def lora_family(keys: Iterable[str]) -> str | None:
    """The model family a LoRA file's layers are named for (FLUX, SD3, SD3_OR_FLUX, SDXL,
    SD1_OR_2), or None when its names are none of these (LyCORIS' own, a bare peft file)."""
    keys = list(keys)
    for found, pattern in _LORA_FAMILIES:
        if any(pattern.search(k) for k in keys):
            return found
    return None


def lora_mismatch(lora_keys: Iterable[str], model: str | None) -> str | None:
    """'a Flux.1 LoRA; this model is SD 1.x' when a LoRA file with `lora_keys` is named for
    another family than `model` (`model_family` of the model it would merge into), else None.
    Unknown on either side is left to the merge, which names the layers it lacks."""
    lora = lora_family(lora_keys)
    fits = {SD1_OR_2: (SD1, SD2), SD3_OR_FLUX: (SD3, FLUX)}.get(lora, (lora,))
    if lora is None or model is None or model in fits:
        return None
    return f"{a(lora)} LoRA; this model is {model}"


def is_sdxl(source) -> bool:
    """Whether `source` is SDXL - the one SDXL test: loaders, scripts, the config translation
    and the LoRA file names all ask it. `source` is what they hold:

    - a built model, a state dict or its keys: `model_family` says SDXL (sgm's conditioner
      keys, `conditioner.embedders.*`);
    - a model config (`{"target", "params"}`: ours, CompVis's or sgm's, translated or not): its
      conditioner is sgm's `GeneralConditioner` (the module those keys belong to) over a UNet
      backbone - read from the config, nothing built (an SDXL config names tokenizer and weight
      files that need not be there yet);
    - a diffusers `UNet2DConditionModel` config (`unet/config.json`): SDXL's size and crop
      conditioning, `addition_embed_type: text_time` (diffusers'
      `create_unet_diffusers_config_from_ldm` sets it for SDXL)."""
    if isinstance(source, Mapping) and "target" in source:
        return _config_is_sdxl(source)
    if isinstance(source, Mapping) and ("addition_embed_type" in source or "_class_name" in source):
        return source.get("addition_embed_type") == "text_time"
    return model_family(source) == SDXL


# A model config's backbone and conditioner, under their names in our configs, sgm's and CompVis'.
_BACKBONE_CONFIGS = ("backbone_config", "network_config", "unet_config")
_CONDITIONER_CONFIGS = ("conditioner_config", "cond_stage_config")


def _config_is_sdxl(model_config: Mapping) -> bool:
    params = model_config.get("params") or {}

    def target(names: tuple[str, ...]) -> str:
        config = next((params[k] for k in names if isinstance(params.get(k), Mapping)), {})
        return str(config.get("target", ""))

    backbone = target(
        _BACKBONE_CONFIGS
    )  # a UNetModel (CompVis', sgm's, ours) or an ldm.unet preset
    unet = backbone.endswith(".UNetModel") or backbone.startswith("ldm.unet.")
    return unet and target(_CONDITIONER_CONFIGS).endswith(".GeneralConditioner")


def _config_family(model_config: Mapping) -> str | None:
    import torch

    from ldm.util import instantiate_from_config

    model_config = copy.deepcopy(dict(model_config))
    model_config["params"] = {**(model_config.get("params") or {}), "ckpt_path": None}
    # Adapters name no family (their keys are read without them) and would print their line a
    # second time: the run builds the model itself.
    model_config["params"].pop("lora", None)
    try:
        with torch.device("meta"):
            model = instantiate_from_config(model_config)
    except Exception:  # noqa: BLE001 - a part that reads files or data as it is built
        return None  # unknown: the strict load that follows names any mismatch
    return model_family(model)


def diffusers_family(folder: str | Path) -> str | None:
    """A diffusers pipeline folder's family, from its `model_index.json` pipeline class (and,
    for StableDiffusionPipeline, its text encoder: OpenCLIP ViT-H uses `gelu`, OpenAI's CLIP
    `quick_gelu`)."""
    folder = Path(folder)
    try:
        name = json.loads((folder / "model_index.json").read_text()).get("_class_name", "")
    except (OSError, ValueError):
        return None
    if name.startswith("Flux"):
        return FLUX
    if name.startswith("StableDiffusion3"):
        return SD3
    if "XL" in name:
        return SDXL
    if name.startswith("DiT"):
        return DIT
    if name.startswith("StableDiffusion"):
        try:
            text = json.loads((folder / "text_encoder" / "config.json").read_text())
        except (OSError, ValueError):
            return None
        # an unknown activation is left to the folder reader (ldm.layout.diffusers), which
        # names the file and the value
        act = text.get("hidden_act", DEFAULT_CLIP_ACTIVATION)
        return CLIP_ACTIVATIONS.get(act, (None,))[0]
    return None


def file_keys(path: str | Path, unsafe: bool = False) -> list[str]:
    """The tensor names in a weights file, without reading its tensors (a DiT `train.py`
    checkpoint: its `ema` entry's). Missing, refused or damaged files raise as `ldm.safe_load`
    does: FileNotFoundError, UnsafeCheckpointError, ValueError - each naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    from ldm.safe_load import check_readable, load_file_state

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        check_readable(path)  # empty or damaged: the line loading the file would say
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return file_state_keys(load_file_state(path, unsafe=unsafe, mmap=True))


def file_family(path: str | Path, unsafe: bool = False) -> str | None:
    """`model_family` of a file, or of a diffusers folder."""
    if Path(path).is_dir():
        return diffusers_family(path)
    return model_family(file_keys(path, unsafe))


def a(family: str) -> str:
    """The family's name with its article: 'an SDXL' (an ess-dee), 'a DiT', 'a VAE'."""
    return ("an " if family.startswith("SD") else "a ") + family


def describe(path: str | Path, family: str | None) -> str:
    """'a diffusers folder (SDXL)', 'an SDXL checkpoint', 'a LoRA file', 'a VAE checkpoint'."""
    if path and Path(path).is_dir():
        return f"a diffusers folder ({family})"
    return "a LoRA file" if family == LORA else f"{a(family)} checkpoint"


# The two kinds of KL VAE, told apart by one key: SD 1.x/2.x/SDXL's (4 latent channels) has the 1x1
# `quant_conv` around the latent; SD 3/3.5's (16 channels; Flux's too) has none (Stability's
# sd3_impls.SDVAE, diffusers' `use_quant_conv: false`). Same name in both layouts.
VAE4, VAE16 = (
    "an SD VAE (4 latent channels, with quant_conv)",
    "a 16-channel SD3 VAE (no quant_conv)",
)
VAE_KIND_FILES = {
    VAE4: "an SD 1.x/2.x/SDXL VAE or checkpoint",
    VAE16: "an SD 3/3.5 VAE or checkpoint (first_stage_model.*)",
}


def vae_kind(keys: Iterable[str]) -> str | None:
    """VAE4 or VAE16 of state-dict `keys` holding a KL VAE (bare, under `first_stage_model.`
    or in diffusers' names), None when they hold no VAE encoder."""
    keys = [k.removeprefix("first_stage_model.") for k in keys]
    if not any(k.startswith("encoder.conv_in.") for k in keys):
        return None
    return VAE4 if any(k.startswith("quant_conv.") for k in keys) else VAE16
