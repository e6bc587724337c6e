"""The LoRA file formats other tools read: kohya-ss (A1111, ComfyUI, Forge, diffusers) and
diffusers/peft - the names and metadata; `ldm.lora` fills them with tensors.

kohya names a SD 1.x/2.x UNet module by its diffusers path with `.` -> `_`
(`lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`) and a CLIP text
encoder module by its transformers path (`lora_te_text_model_encoder_layers_0_self_attn_q_proj`).
Our modules carry the original CompVis names, so the UNet's are mapped here: the rule is the
inverse of AUTOMATIC1111's `convert_diffusers_name_to_compvis` (shared/reference/README.md,
"kohya LoRA (SD1)"), written for any number of ResBlocks per level.

SDXL is different: kohya-ss trains it on its own sgm UNet (library/sdxl_original_unet.py), so an
SDXL UNet module is named by its original name (`lora_unet_input_blocks_4_1_transformer_blocks_0_
attn1_to_q`, networks/lora.py `create_modules`: prefix + module path, `.` -> `_`), and the two
text encoders are `lora_te1_` (CLIP ViT-L) and `lora_te2_` (OpenCLIP bigG as the HF
CLIPTextModelWithProjection library/sdxl_model_util.py converts it to), both by their
transformers paths. diffusers reads those names back (lora_conversion_utils.py:
`_maybe_map_sgm_blocks_to_diffusers`, `_convert_non_diffusers_lora_to_diffusers`).
"""

import json
import re

from ldm.layout.original import (
    CLIP_LEVEL,
    CLIP_PREFIX,
    OPENCLIP_PREFIX,
    SGM_CLIP_PREFIX,
    SGM_OPENCLIP_PREFIX,
    UNET_PREFIX,
)

KOHYA_UNET = "lora_unet_"
# kohya's prefix of each diffusers pipeline component: SD 1.x / 2.x, and SDXL (sdxl=True).
KOHYA_PREFIXES = {
    False: {"unet": KOHYA_UNET, "text_encoder": "lora_te_"},
    True: {"unet": KOHYA_UNET, "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"},
}
# Inside a ResBlock: CompVis name -> diffusers name.
RESNET_NAMES = {
    "in_layers.0": "norm1",
    "in_layers.2": "conv1",
    "emb_layers.1": "time_emb_proj",
    "out_layers.0": "norm2",
    "out_layers.3": "conv2",
    "skip_connection": "conv_shortcut",
}
# OpenCLIP block -> HF CLIP encoder layer (the conversion kohya and diffusers make for SD 2.x).
OPENCLIP_TO_HF = {
    "attn.in_proj.q": "self_attn.q_proj",
    "attn.in_proj.k": "self_attn.k_proj",
    "attn.in_proj.v": "self_attn.v_proj",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
TOP_LEVEL_NAMES = {
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "input_blocks.0.0": "conv_in",
    "out.0": "conv_norm_out",
    "out.2": "conv_out",
}


def _resnet_inner(inner: str) -> str:
    for ours, theirs in RESNET_NAMES.items():
        if inner == ours or inner.startswith(ours + "."):
            return theirs + inner[len(ours) :]
    raise ValueError(f"not a ResBlock module: {inner}")


def _block_part(kind: str, level: int, index: int, layer: int, inner: str) -> str:
    """One layer of a down/up block: layer 0 is the ResBlock, then the attention (a
    SpatialTransformer: norm, proj_in, transformer_blocks, proj_out) or the resampler (`op` /
    `conv`, the only names Downsample / Upsample have)."""
    block = f"{kind}_blocks.{level}"
    if layer == 0 and not inner.startswith(("op", "conv")):
        return f"{block}.resnets.{index}.{_resnet_inner(inner)}"
    if inner == "op" or inner == "conv":  # Downsample.op / Upsample.conv
        sampler = "downsamplers" if kind == "down" else "upsamplers"
        return f"{block}.{sampler}.0.conv"
    return f"{block}.attentions.{index}.{inner}"


def diffusers_unet_path(name: str, res_blocks: int) -> str:
    """A UNet module's CompVis name (in `UNetModel`) -> its diffusers `UNet2DConditionModel` path.

    res_blocks: ResBlocks per level on the way down (`num_res_blocks`; one more on the way up).
    e.g. `output_blocks.7.1.transformer_blocks.0.attn2.to_k` with 2 ->
    `up_blocks.2.attentions.1.transformer_blocks.0.attn2.to_k`.
    """
    for ours, theirs in TOP_LEVEL_NAMES.items():
        if name == ours:
            return theirs
    found = re.fullmatch(
        r"(input_blocks|middle_block|output_blocks)\.(\d+)(?:\.(\d+))?\.(.+)", name
    )
    if found is None:
        raise ValueError(f"no diffusers name for UNet module '{name}'")
    part, first, second, inner = found[1], int(found[2]), found[3], found[4]
    if part == "middle_block":  # ResBlock, attention, ResBlock (no second index)
        if first == 1:
            return f"mid_block.attentions.0.{inner}"
        return f"mid_block.resnets.{first // 2}.{_resnet_inner(inner)}"
    if second is None:
        raise ValueError(f"no diffusers name for UNet module '{name}'")
    layer = int(second)
    if part == "input_blocks":  # block 0 is conv_in; then per level res_blocks + a Downsample
        level, index = divmod(first - 1, res_blocks + 1)
        return _block_part("down", level, index, layer, inner)
    level, index = divmod(first, res_blocks + 1)
    return _block_part("up", level, index, layer, inner)


def openclip_hf_path(name: str) -> str:
    """An OpenCLIP text-tower module (SD 2.x, `ldm.text_encoder.OpenCLIPTextTransformer`) ->
    its path in the HF CLIPTextModel that kohya-ss (model_util.convert_ldm_clip_checkpoint_v2)
    and diffusers (single_file_utils.convert_open_clip_checkpoint) convert it to; the fused
    q/k/v as `attn.in_proj.q|k|v` (its split rows, see `ldm.lora._exported_parts`)."""
    found = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", name)
    if found is None or found[2] not in OPENCLIP_TO_HF:
        raise ValueError(f"no HF CLIP name for OpenCLIP module '{name}'")
    return f"text_model.encoder.layers.{found[1]}.{OPENCLIP_TO_HF[found[2]]}"


def module_path(key: str, res_blocks: int) -> tuple[str, str]:
    """A module's name in `LatentDiffusion` -> (component, path in the diffusers pipeline's
    component): ("unet", "down_blocks.0...") or ("text_encoder", "text_model.encoder..."); SDXL's
    OpenCLIP tower is ("text_encoder_2", ...), as in diffusers' StableDiffusionXLPipeline."""
    if key.startswith(UNET_PREFIX):
        return "unet", diffusers_unet_path(key.removeprefix(UNET_PREFIX), res_blocks)
    for prefix in (CLIP_PREFIX, SGM_CLIP_PREFIX):
        if key.startswith(prefix + CLIP_LEVEL):
            return "text_encoder", key.removeprefix(prefix)
    if key.startswith(OPENCLIP_PREFIX + "transformer."):
        return "text_encoder", openclip_hf_path(key.removeprefix(OPENCLIP_PREFIX))
    if key.startswith(SGM_OPENCLIP_PREFIX + "transformer."):
        return "text_encoder_2", openclip_hf_path(key.removeprefix(SGM_OPENCLIP_PREFIX))
    raise ValueError(f"no kohya / diffusers LoRA name for module '{key}'")


def kohya_names(key: str, res_blocks: int, sdxl: bool = False) -> list[str]:
    """A module's name in `LatentDiffusion` -> its kohya LoRA names (without `.lora_down...`),
    the one kohya writes first. SDXL's UNet modules keep their original name; the second
    spelling, `lora_unet_<diffusers path>`, is what diffusers' `convert_state_dict_to_kohya`
    writes for SDXL (and ComfyUI reads), accepted when reading."""
    component, path = module_path(key, res_blocks)
    prefixes = KOHYA_PREFIXES[sdxl]
    if component not in prefixes:
        raise ValueError(f"no kohya LoRA name for module '{key}' in a non-SDXL model")
    by_path = prefixes[component] + path.replace(".", "_")
    if sdxl and component == "unet":
        return [KOHYA_UNET + key.removeprefix(UNET_PREFIX).replace(".", "_"), by_path]
    return [by_path]


def kohya_name(key: str, res_blocks: int, sdxl: bool = False) -> str:
    """The kohya LoRA name kohya-ss writes for a module (`kohya_names`)."""
    return kohya_names(key, res_blocks, sdxl)[0]


# diffusers/peft-format files: `<component>.<path>.lora_A.weight` / `.lora_B.weight` (and DoRA's
# `.lora_magnitude_vector`), the format `pipeline.save_lora_weights` writes.
DIFFUSERS_KEY = re.compile(r"([^.]+)\.(.+)\.(lora_A|lora_B|lora_magnitude_vector)(?:\.weight)?")


LORA_ADAPTER_METADATA = "lora_adapter_metadata"  # diffusers' safetensors key (lora_base.py)


def is_diffusers_format(state) -> bool:
    return any(DIFFUSERS_KEY.fullmatch(k) for k in state)


def diffusers_metadata(state) -> dict[str, str]:
    """The safetensors metadata of a diffusers-format LoRA file, as diffusers writes it
    (lora_base.py `_save_lora_weights` / `write_lora_layers`): `format: pt` and, under
    `lora_adapter_metadata`, each component's peft `LoraConfig.to_dict()` with its fields
    prefixed `unet.` / `text_encoder.` / `text_encoder_2.` / `transformer.`, JSON with sorted
    keys. diffusers' `load_lora_weights` then builds `LoraConfig(**fields)` from it instead of
    inferring one from the tensors (peft_utils.py `_create_lora_config`).

    Read from the file's own tensors, so it is exact for the file: every layer's rank (the
    most common one as `r`, the others - LoCon's `conv_rank` - in `rank_pattern`), DoRA (a
    `lora_magnitude_vector`) and the target modules. Our files hold alpha / rank in lora_B
    (readers without this metadata, ComfyUI, older diffusers, get the same update), so each
    layer's alpha is its rank: `lora_alpha = r`, `alpha_pattern = rank_pattern`. Text-encoder
    modules are named without CLIPTextModel's `text_model.` level: peft matches the end of a
    name, so they fit transformers 4 (with it) and 5 (without)."""
    from collections import Counter

    from peft import LoraConfig

    ranks, dora = {}, set()
    for key, value in state.items():
        found = DIFFUSERS_KEY.fullmatch(key)
        if found is None:
            continue
        component, path, part = found.groups()
        if component.startswith("text_encoder"):
            path = path.removeprefix(CLIP_LEVEL)
        if part == "lora_A":
            ranks.setdefault(component, {})[path] = value.shape[0]
        elif part == "lora_magnitude_vector":
            dora.add(component)
    fields = {}
    for component, layers in ranks.items():
        r = Counter(layers.values()).most_common(1)[0][0]
        pattern = {path: rank for path, rank in sorted(layers.items()) if rank != r}
        config = LoraConfig(
            r=r,
            lora_alpha=r,
            rank_pattern=pattern,
            alpha_pattern=dict(pattern),
            target_modules=sorted(layers),
            use_dora=component in dora,
        ).to_dict()
        # diffusers' rule: sets as lists (target_modules is one in peft's config)
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        fields.update({f"{component}.{k}": v for k, v in config.items()})
    return {"format": "pt", LORA_ADAPTER_METADATA: json.dumps(fields, indent=2, sort_keys=True)}


def _diffusers_alpha(config: dict, component: str, path: str, rank: int) -> float:
    """A layer's alpha by diffusers' rule: `lora_adapter_metadata`'s alpha_pattern (peft's
    match: the pattern ends the module path) or lora_alpha; with no metadata alpha = rank."""
    for pattern, alpha in config.get(f"{component}.alpha_pattern", {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", path):
            return float(alpha)
    return float(config.get(f"{component}.lora_alpha", rank))


def from_diffusers(state, metadata: dict | None = None, sdxl: bool = False) -> tuple[dict, dict]:
    """A diffusers-format LoRA state dict -> (the same layers under kohya names, with `.alpha`,
    as `ldm.lora.merge_kohya` reads them; DoRA magnitudes by kohya name, peft's own values).
    sdxl: the file is for SDXL (components unet, text_encoder, text_encoder_2)."""
    import torch

    config = json.loads((metadata or {}).get(LORA_ADAPTER_METADATA) or "{}")
    kohya, magnitudes = {}, {}
    for key, value in state.items():
        found = DIFFUSERS_KEY.fullmatch(key)
        if found is None:
            continue
        component, path, part = found.groups()
        prefixes = KOHYA_PREFIXES[sdxl]
        if component not in prefixes:
            family = "an SDXL" if sdxl else "a SD 1.x/2.x"
            raise ValueError(
                f"{key}: a LoRA layer of '{component}', not of {family} UNet or text encoder"
            )
        if component.startswith("text_encoder") and not path.startswith(CLIP_LEVEL):
            path = CLIP_LEVEL + path  # transformers >= 5 dropped CLIPTextModel's level
        name = prefixes[component] + path.replace(".", "_")
        if part == "lora_A":
            kohya[f"{name}.lora_down.weight"] = value
            alpha = _diffusers_alpha(config, component, path, value.shape[0])
            kohya[f"{name}.alpha"] = torch.tensor(alpha)
        elif part == "lora_B":
            kohya[f"{name}.lora_up.weight"] = value
        else:
            magnitudes[name] = value
    return kohya, magnitudes


def kohya_metadata(settings, base_version: str) -> dict[str, str]:
    """The `ss_*` metadata kohya's train_network.py writes that loaders read (all strings), for
    `ldm.lora.LoraSettings`; base_version: kohya's `ss_base_model_version` ("sd_v1", "sd_v2",
    "sd_v2_v", or "sdxl_base_v1-0", sdxl_model_util.MODEL_VERSION_SDXL_BASE_V1_0)."""
    network_args = {}
    if "conv" in settings.targets:  # the 3x3 convolutions' rank and alpha (LoraSettings.conv)
        conv_rank, conv_alpha = settings.conv
        network_args["conv_dim"] = str(conv_rank)
        network_args["conv_alpha"] = f"{conv_alpha:g}"  # kohya: the string given, "1"
    if settings.dora:
        network_args["dora_wd"] = "True"
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(settings.rank),
        "ss_network_alpha": str(float(settings.scale_alpha)),
        "ss_network_dropout": str(settings.dropout),
        "ss_base_model_version": base_version,
        "ss_v2": str(base_version.startswith("sd_v2")),
        "ss_training_comment": "lun-diffusion",
    }
    if network_args:
        meta["ss_network_args"] = json.dumps(network_args)
    return meta


# --- the base model a LoRA file was trained on, as kohya-ss/sd-scripts names it ------------------
# ss_base_model_version: train_network.py (SD 1/2: model_util.get_model_version_str_for_sd1_sd2),
# sdxl_train_network.py ("sdxl_base_v1-0"), sd3_train_network.py (the MMDiT's model_type, read from
# the weights by sd3_utils.analyze_state_dict_state: "medium", "5-medium" or "5-large") and
# flux_train_network.py (flux_utils.MODEL_VERSION_FLUX_V1, "flux1"). The modelspec.* keys: kohya's
# library/sai_model_spec.py (ModelSpec 1.0.1, determine_architecture / determine_implementation /
# determine_resolution without a resolution given).
MODELSPEC_VERSION = "1.0.1"
IMPL_DIFFUSERS = "diffusers"
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_FLUX = "https://github.com/black-forest-labs/flux"


def sd3_model_type(keys) -> str:
    """kohya's SD3 model_type: QK RMSNorm without attn2 is 3.5 Large, with it 3.5 Medium
    (MMDiT-X), none SD 3 Medium."""
    qk_norm = any(k.endswith("joint_blocks.0.context_block.attn.ln_k.weight") for k in keys)
    attn2 = any(re.search(r"\.\d+\.x_block\.attn2\.ln_k\.weight$", k) for k in keys)
    return ("5-medium" if attn2 else "5-large") if qk_norm else "medium"


def base_model_metadata(family: str | None, keys, parameterization: str = "eps") -> dict[str, str]:
    """`ss_base_model_version` and the required modelspec keys of a LoRA file, for a model of
    `family` (ldm.layout.family's names) whose state dict has `keys`."""
    from ldm.layout import family as families
    from ldm.layout import flux

    v = parameterization == "v"
    resolution = "1024x1024"
    implementation = IMPL_DIFFUSERS
    if family == families.SD3:
        model_type = sd3_model_type(keys)
        version, architecture = model_type, f"stable-diffusion-3-{model_type}"
    elif family == families.FLUX:
        version, architecture = "flux1", f"flux-1-{flux.variant(dict.fromkeys(keys))}"
        implementation = IMPL_FLUX
    elif family == families.SDXL:
        version, architecture = "sdxl_base_v1-0", "stable-diffusion-xl-v1-base"
        implementation = IMPL_STABILITY_AI  # kohya: "lora and sdxl"
    elif family == families.SD2:
        version = "sd_v2_v" if v else "sd_v2"
        architecture = "stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512"
        resolution = "768x768" if v else "512x512"
    else:
        version, architecture, resolution = (
            "sd_v1_v" if v else "sd_v1",
            "stable-diffusion-v1",
            "512x512",
        )
    meta = {
        "ss_base_model_version": version,
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": architecture + "/lora",
        "modelspec.implementation": implementation,
        "modelspec.title": "LoRA",
        "modelspec.resolution": resolution,
    }
    # kohya's build_metadata_dataclass writes "v" or "epsilon"; only for the UNet families here,
    # where it is the model's own parameterization (SD 3 / Flux are rectified flow: neither)
    prediction = {"eps": "epsilon", "v": "v"}.get(parameterization)
    if family not in (families.SD3, families.FLUX) and prediction:
        meta["modelspec.prediction_type"] = prediction
    return meta
