"""Which layers get adapters: the UNet's groups (kohya-ss's networks), the transformer backbones'
own rules (`backbone_family`), the text encoders' (`lora_targets()` of each conditioner), and how
a layer with adapters is found again (`adapter_layers`)."""

import dataclasses
import re

from torch import nn

from ldm.layout import peft

ADAPTER = "default"  # peft's adapter name for the adapters we train

# Layers per target group, by the end of their CompVis name (UNetModel / SpatialTransformer).
UNET_GROUPS = {
    "attn": r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)",
    "proj": r"\.(proj_in|proj_out)",
    "ff": r"\.ff\.net\.(0\.proj|2)",
    # LoCon: ResBlock convs, time-embedding projection and shortcut, Downsample / Upsample.
    "conv": r"\.(in_layers\.2|out_layers\.3|emb_layers\.1|skip_connection|op|conv)",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformer backbone that owns its LoRA rules: `targets(backbone)` names the Linear
    layers LoRA adapts, `layout` (an ldm.layout.kohya_* module) writes and reads its files:
    `peft_adapters`, `to_kohya`, `from_kohya`, `to_diffusers`. The UNet's rules stay here and in
    ldm.layout.kohya."""

    name: str
    targets: object
    layout: object


def backbone_family(backbone: nn.Module) -> Family | None:
    """The LoRA rules of `backbone` (a LatentDiffusion's `backbone`), or None for the UNet: the
    one place that tells the families apart."""
    from ldm import flux, mmdit
    from ldm.layout import kohya_flux, kohya_sd3

    if isinstance(backbone, mmdit.MMDiT):
        return Family("SD3 MMDiT", mmdit.lora_targets, kohya_sd3)
    if isinstance(backbone, flux.Flux):
        return Family("Flux", flux.lora_targets, kohya_flux)
    return None


def lora_able(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d))


def unet_targets(unet: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Names (in `unet`) of the Linear / Conv2d layers of the target groups, in module order."""
    pattern = re.compile("(" + "|".join(UNET_GROUPS[t] for t in targets) + ")$")
    return [n for n, m in unet.named_modules() if lora_able(m) and pattern.search("." + n)]


def layer_name(name: str) -> str:
    """A LoRA layer's module name without peft's `base_layer` levels (a layer inside a wrapped
    one: OpenCLIP's `attn.base_layer.out_proj` under the q/k/v parameter's wrapper)."""
    return peft.without_base_level(name)


def is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def has_adapters(module: nn.Module) -> bool:
    return any(is_lora_layer(m) for m in module.modules())


def res_blocks_of(unet: nn.Module) -> int:
    """`num_res_blocks` of a built UNetModel: the up path has num_res_blocks + 1 per level."""
    from ldm.unet import Downsample

    levels = 1 + sum(isinstance(m, Downsample) for m in unet.modules())
    return len(unet.output_blocks) // levels - 1


def adapter_layers(model: nn.Module, adapter: str = ADAPTER) -> dict[str, nn.Module]:
    """The LoRA layers of `model` by their original module name (`model.diffusion_model...`)."""
    return {
        layer_name(name): layer
        for name, layer in model.named_modules()
        if is_lora_layer(layer) and adapter in layer.lora_A
    }
