"""Adapters as files: the kohya format (AUTOMATIC1111, ComfyUI, Forge, kohya-ss) and the
diffusers/peft format `pipeline.load_lora_weights` reads. Names come from `ldm.layout.kohya` (UNet,
CLIP, OpenCLIP) or the backbone's own layout (`ldm.layout.kohya_sd3`, `kohya_flux`)."""

import torch
from torch import nn

from ldm.layout import kohya as lora_kohya
from ldm.layout.family import is_sdxl  # kohya names SDXL's layers its own way
from ldm.lora.targets import ADAPTER, adapter_layers, backbone_family, res_blocks_of


def _exported_parts(name: str, layer, adapter: str):
    """(module name, lora_A, lora_B) of a layer as kohya / diffusers files hold it. OpenCLIP's
    fused q/k/v LoRA (W_qkv + B A, B stacked q/k/v rows) is three LoRAs of the split q/k/v
    weights that share A: exactly the layers of the HF CLIP model that kohya and diffusers
    convert SD 2.x's text encoder to."""
    down, up = layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach()
    if not _is_fused_qkv(layer):
        return [(name, down, up)]
    parts = zip("qkv", up.chunk(3))  # copies: a file holds each tensor on its own
    return [(f"{name}.in_proj.{part}", down.clone(), rows.clone()) for part, rows in parts]


def _is_fused_qkv(layer) -> bool:
    return getattr(layer, "parameter_name", None) == "in_proj_weight"


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W||_2 of each output row, shaped (out, 1, ...) like W's dims."""
    return weight.reshape(weight.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))


def _dora_scale(layer, adapter: str) -> torch.Tensor | None:
    """DoRA's magnitude as the kohya-format loaders (ComfyUI, Forge) apply an output-axis
    `dora_scale` (shape (out, 1) / (out, 1, 1, 1)): W' = (W + dW) * dora_scale / ||W||, the norm
    of the *base* rows - where peft and the DoRA paper divide by ||W + dW||. Written as
    m * ||W|| / ||W + dW||, so those loaders give exactly peft's W' = m (W + dW) / ||W + dW||."""
    if not layer.use_dora.get(adapter):
        return None
    weight = layer.get_base_layer().weight.detach().float()
    delta = layer.get_delta_weight(adapter).detach().float().reshape(weight.shape)
    magnitude = layer.lora_magnitude_vector[adapter].weight.detach().float()
    magnitude = magnitude.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    return magnitude * _row_norms(weight) / _row_norms(weight + delta)


def _magnitude_of(layer, adapter: str, dora_scale: torch.Tensor, source: str) -> torch.Tensor:
    """The inverse of `_dora_scale`: peft's magnitude for a file's output-axis `dora_scale`."""
    weight = layer.get_base_layer().weight.detach().float()
    if dora_scale.shape[0] != weight.shape[0] or dora_scale.numel() != weight.shape[0]:
        raise ValueError(
            f"{source}: dora_scale of shape {tuple(dora_scale.shape)} is on the input axis "
            "(LyCORIS wd_on_out=False); only output-axis DoRA files are supported"
        )
    delta = layer.get_delta_weight(adapter).detach().float().reshape(weight.shape)
    magnitude = dora_scale.float().reshape(_row_norms(weight).shape)
    return magnitude * _row_norms(weight + delta) / _row_norms(weight)


def kohya_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters of a LatentDiffusion as a kohya LoRA state dict: per layer
    `<name>.lora_down.weight` (A), `.lora_up.weight` (B), `.alpha` (0-dim) and, for DoRA,
    `.dora_scale`; kohya applies up @ down * alpha / rank, as peft does."""
    family = backbone_family(model.backbone)
    if family is not None:
        return family.layout.to_kohya(family.layout.peft_adapters(model), dtype)
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    state = {}
    for name, layer in adapter_layers(model).items():
        for part, down, up in _exported_parts(name, layer, ADAPTER):
            kohya = lora_kohya.kohya_name(part, res_blocks, sdxl)
            state[f"{kohya}.lora_down.weight"] = down
            state[f"{kohya}.lora_up.weight"] = up
            state[f"{kohya}.alpha"] = torch.tensor(float(layer.lora_alpha[ADAPTER]))
        scale = _dora_scale(layer, ADAPTER)
        if scale is not None:
            state[f"{kohya}.dora_scale"] = scale
    return {k: v.to(dtype or v.dtype).contiguous() for k, v in state.items()}


def diffusers_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in the diffusers/peft format `pipeline.load_lora_weights` reads natively:
    `unet.<diffusers path>.lora_A.weight` / `.lora_B.weight` (and `text_encoder.`). The
    scale alpha / rank is folded into lora_B, so the file needs no alpha (diffusers takes 1).
    SD3 and Flux: `transformer.<diffusers path>...`, fused q/k/v split (ldm.layout.kohya_*)."""
    family = backbone_family(model.backbone)
    if family is not None:
        return family.layout.to_diffusers(family.layout.peft_adapters(model))
    res_blocks = res_blocks_of(model.backbone)
    state = {}
    for name, layer in adapter_layers(model).items():
        scaling = layer.lora_alpha[ADAPTER] / layer.r[ADAPTER]
        for part, down, up in _exported_parts(name, layer, ADAPTER):
            component, path = lora_kohya.module_path(part, res_blocks)
            key = f"{component}.{path}"
            state[f"{key}.lora_A.weight"] = down.float()
            state[f"{key}.lora_B.weight"] = up.float() * scaling
        if layer.use_dora.get(ADAPTER):
            # peft's own shape: (out,) for Linear, (1, out, 1, 1) for Conv2d
            state[f"{key}.lora_magnitude_vector.weight"] = (
                layer.lora_magnitude_vector[ADAPTER].weight.detach().float()
            )
    return {k: v.cpu().contiguous() for k, v in state.items()}
