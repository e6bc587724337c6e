"""LoRA, LoCon and DoRA adapters (peft) on the backbone and the text encoders, and their files.

LoRA (Hu et al. 2021, arXiv:2106.09685) trains a low-rank update W + (alpha / r) * B A of a
frozen weight W (A: r x in, B: out x r, B starts at zero). LoCon (LyCORIS) puts the same update on
the ResBlock and resampler convolutions (A is a kh x kw conv, B a 1x1 conv), usually with its own
rank. DoRA (Liu et al. 2024, arXiv:2402.09353) also learns the magnitude of each output row:
W' = m * (W + s B A) / ||W + s B A||. The layers are peft's; this package chooses which layers get
them (the groups kohya-ss's networks use), keeps the base frozen in the training dtype, and
writes and reads the kohya file format that AUTOMATIC1111, ComfyUI, Forge and diffusers load.

One module per concern, each the one owner of its rules:

- `settings`: `model.params.lora` parsed and checked (`LoraSettings`, `parse_settings`);
- `targets`: which layers (the UNet's groups; `backbone_family` for SD3 / Flux; the text
  encoders' own `lora_targets()`), and finding adapter layers again;
- `inject`: the adapters made (`add_adapters`, `after_loading`);
- `base`: the frozen base held in the training dtype, quantized, swapped (`hold_base_for_training`);
- `checkpoints`: a run's checkpoints in the original layout (`save_layout`, `load_layout`);
- `files`: kohya / diffusers files (`kohya_state_dict`, `diffusers_state_dict`);
- `merge`: adapters folded into the base (`merge_adapters`, `merge_file`);
- `mode`: all of it as the training mode `LatentDiffusion` calls (`ldm.adapters`).

Checkpoint key rules live in `ldm.layout.peft`, kohya / diffusers names in `ldm.layout.kohya`.
The names below stay importable from `ldm.lora` (scripts and tests use them).
"""

from ldm.layout.family import is_sdxl  # the one SDXL test, kept importable from here
from ldm.lora.base import (
    hold_base_for_training,
    hold_frozen_in,
    quantize_base,
    quantize_blocks,
    training_dtype,
)
from ldm.lora.checkpoints import load_layout, save_layout
from ldm.lora.files import _exported_parts, diffusers_state_dict, kohya_state_dict
from ldm.lora.inject import add_adapters, after_loading, summary
from ldm.lora.merge import _unload, kohya_modules, merge_adapters, merge_file, merge_kohya
from ldm.lora.settings import (
    BASE_DTYPES,
    INITS,
    LoraSettings,
    TextEncoderLora,
    parse_settings,
)
from ldm.lora.targets import (
    ADAPTER,
    UNET_GROUPS,
    Family,
    adapter_layers,
    backbone_family,
    has_adapters,
    layer_name,
    res_blocks_of,
    unet_targets,
)
from ldm.text_encoder import clip_lora_layers as text_targets
from ldm.text_encoder import openclip_lora_layers as openclip_targets

__all__ = [
    "ADAPTER",
    "BASE_DTYPES",
    "INITS",
    "UNET_GROUPS",
    "Family",
    "LoraSettings",
    "TextEncoderLora",
    "_exported_parts",
    "_unload",
    "adapter_layers",
    "add_adapters",
    "after_loading",
    "backbone_family",
    "diffusers_state_dict",
    "has_adapters",
    "is_sdxl",
    "hold_base_for_training",
    "hold_frozen_in",
    "kohya_modules",
    "kohya_state_dict",
    "layer_name",
    "load_layout",
    "merge_adapters",
    "merge_file",
    "merge_kohya",
    "openclip_targets",
    "parse_settings",
    "quantize_base",
    "quantize_blocks",
    "res_blocks_of",
    "save_layout",
    "summary",
    "text_targets",
    "training_dtype",
    "unet_targets",
]
