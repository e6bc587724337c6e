"""The original single-file layout (CompVis SD 1.x / 2.x, Stability's sgm SDXL): the names our
modules carry, so `LatentDiffusion.state_dict()` is an original checkpoint with no renaming hooks
(hooks would collide with the ones FSDP and DeepSpeed install).

- `model.diffusion_model.*`: the backbone (LatentDiffusion.model holds `diffusion_model`).
- `first_stage_model.*`: the VAE (a VAE file holds the same names bare).
- `cond_stage_model.transformer.*` (SD 1.x, OpenAI CLIP) / `cond_stage_model.model.*` (SD 2.x,
  OpenCLIP), or sgm's `conditioner.embedders.N.*` (SDXL: CLIP ViT-L, OpenCLIP bigG).
- The v1 text encoder on load: files without the `text_model.` level (transformers >= 5.6
  `CLIPTextModel` names) are accepted, and `embeddings.position_ids` (a constant older files
  carry) is dropped; so is sgm's `denoiser.sigmas` (sqrt((1 - alphas_cumprod) / alphas_cumprod),
  a constant, not a weight).
"""

from collections.abc import Mapping

BACKBONE_PREFIX = "model."  # LatentDiffusion.model (the wrapper holding `diffusion_model`)
UNET_MODULE = "diffusion_model."  # the backbone inside that wrapper
UNET_PREFIX = BACKBONE_PREFIX + UNET_MODULE
FIRST_STAGE_PREFIX = "first_stage_model."
COND_STAGE_NAME = "cond_stage_model"  # CompVis: one text encoder
CLIP_PREFIX = COND_STAGE_NAME + ".transformer."  # SD 1.x's OpenAI CLIP ViT-L
OPENCLIP_PREFIX = COND_STAGE_NAME + ".model."  # SD 2.x's OpenCLIP ViT-H text tower
# The original VAE's own top-level modules (a VAE file's keys start with one of them).
VAE_PARTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")
SGM_CONDITIONER = "conditioner."
SGM_EMBEDDERS = SGM_CONDITIONER + "embedders."
SGM_CLIP_PREFIX = SGM_EMBEDDERS + "0.transformer."  # SDXL's CLIP ViT-L
SGM_OPENCLIP_PREFIX = SGM_EMBEDDERS + "1.model."  # SDXL's OpenCLIP bigG text tower
SGM_CONSTANTS = ("denoiser.sigmas",)
CLIP_LEVEL = "text_model."  # transformers' CLIPTextModel level (gone in >= 5.6)
OPENCLIP_BLOCKS = "transformer.resblocks."  # an OpenCLIP tower's blocks
# Where each family keeps its text towers (the last one tells the family apart).
TEXT_PREFIXES = {
    "sd1": (CLIP_PREFIX,),
    "sd2": (OPENCLIP_PREFIX,),
    "sdxl": (SGM_CLIP_PREFIX, SGM_OPENCLIP_PREFIX),
}
# The top-level names of a LatentDiffusion checkpoint (a file without them holds a part alone).
MODEL_PARTS = (BACKBONE_PREFIX, FIRST_STAGE_PREFIX, COND_STAGE_NAME + ".", SGM_CONDITIONER)


def conditioner_name(conditioner) -> str:
    """The conditioner's submodule name in `LatentDiffusion`, which its checkpoint keys start
    with: `cond_stage_model` (CompVis: SD 1.x/2.x, one text encoder), unless the conditioner
    names another (`checkpoint_name = "conditioner"` for sgm's `conditioner.embedders.N.*`)."""
    return getattr(conditioner, "checkpoint_name", COND_STAGE_NAME)


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
            elif not rest.startswith(CLIP_LEVEL):
                state[head + CLIP_LEVEL + rest] = state.pop(key)


def backbone_key(name: str) -> str:
    """`diffusion_model.input_blocks.0.0.weight` -> its checkpoint key `model.diffusion_model...`."""
    return BACKBONE_PREFIX + name


def unet_key(name: str) -> str:
    """A backbone's own name (`input_blocks.0.0.weight`) -> its checkpoint key."""
    return UNET_PREFIX + name


def backbone_names(state: Mapping) -> list[str]:
    """The backbone's parameter names (`diffusion_model.*`) in a checkpoint's state dict."""
    return [k.removeprefix(BACKBONE_PREFIX) for k in state if k.startswith(BACKBONE_PREFIX)]


def has_first_stage(state: Mapping) -> bool:
    return any(k.startswith(FIRST_STAGE_PREFIX) for k in state)


def first_stage_state(state: Mapping) -> dict:
    """The VAE's weights under their bare names: a model checkpoint's `first_stage_model.*`,
    or a VAE file as it is."""
    if not has_first_stage(state):
        return dict(state)
    return {
        k.removeprefix(FIRST_STAGE_PREFIX): v
        for k, v in state.items()
        if k.startswith(FIRST_STAGE_PREFIX)
    }


def first_stage_key(name: str) -> str:
    """A VAE's own name (`decoder.conv_out.weight`) -> its key in a model checkpoint."""
    return FIRST_STAGE_PREFIX + name


def to_transformers_clip(clip_state: Mapping, text_model) -> dict:
    """A CLIP text state dict in the `text_model.*` form -> the names of the installed
    transformers' `CLIPTextModel` (>= 5.6 has no `text_model.` level), without `position_ids`."""
    has_level = any(k.startswith(CLIP_LEVEL) for k in text_model.state_dict())
    return {
        (k if has_level else k.removeprefix(CLIP_LEVEL)): v
        for k, v in clip_state.items()
        if not k.endswith("position_ids")
    }
