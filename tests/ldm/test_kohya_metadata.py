"""The base-model metadata of our kohya LoRA files against what kohya-ss/sd-scripts writes
(commit 48d368f, read for this test):

- sd3_train_network.py: `ss_base_model_version` = the MMDiT's `model_type`, which
  library/sd3_utils.py `analyze_state_dict_state` reads from the weights: "5-large" when
  `joint_blocks.0.context_block.attn.ln_k.weight` exists and no `x_block.attn2.ln_k`, "5-medium"
  with both, "medium" without QK norm; modelspec.architecture "stable-diffusion-3-" + it + "/lora"
  (sai_model_spec.determine_architecture), implementation "diffusers".
- flux_train_network.py: "flux1" (flux_utils.MODEL_VERSION_FLUX_V1); architecture
  "flux-1-dev/lora" or "flux-1-schnell/lora"; implementation
  "https://github.com/black-forest-labs/flux".
- SD 1/2 (model_util.get_model_version_str_for_sd1_sd2) and SDXL ("sdxl_base_v1-0").
"""

import pytest
import torch

from ldm.flux import Flux
from ldm.layout import family
from ldm.layout.kohya import base_model_metadata
from ldm.mmdit import MMDiT

TINY_MMDIT = dict(depth=3, hidden_size=64, num_heads=2, in_channels=4, context_dim=24,
                  pooled_dim=16, pos_embed_max_size=8, sample_size=8)  # fmt: skip
TINY_FLUX = dict(depth=1, depth_single_blocks=1, hidden_size=48, num_heads=2, in_channels=4,
                 context_dim=20, pooled_dim=12, axes_dim=(4, 10, 10))  # fmt: skip


def checkpoint_keys(backbone: torch.nn.Module) -> list[str]:
    """The backbone's keys as a LatentDiffusion's checkpoint holds them (the layout's prefix)."""
    return ["model.diffusion_model." + k for k in backbone.state_dict()]


def metadata_of(backbone, parameterization="flow"):
    keys = checkpoint_keys(backbone)
    return base_model_metadata(family.model_family(keys), keys, parameterization)


@pytest.mark.parametrize(
    "extra, version",
    [
        (dict(), "medium"),  # SD 3 Medium
        (dict(qk_norm=True), "5-large"),
        (dict(qk_norm=True, dual_attention_layers=(0, 1)), "5-medium"),  # MMDiT-X
    ],
)
def test_sd3_files_name_the_mmdit_as_kohya_sd3_scripts_do(extra, version):
    with torch.device("meta"):
        meta = metadata_of(MMDiT(**TINY_MMDIT, **extra))
    assert meta["ss_base_model_version"] == version
    assert meta["modelspec.architecture"] == f"stable-diffusion-3-{version}/lora"
    assert meta["modelspec.implementation"] == "diffusers"
    assert meta["modelspec.sai_model_spec"] == "1.0.1"
    assert meta["modelspec.resolution"] == "1024x1024"


@pytest.mark.parametrize("guidance, variant", [(True, "dev"), (False, "schnell")])
def test_flux_files_name_the_variant_as_kohya_flux_scripts_do(guidance, variant):
    with torch.device("meta"):
        meta = metadata_of(Flux(**TINY_FLUX, guidance_embed=guidance))
    assert meta["ss_base_model_version"] == "flux1"
    assert meta["modelspec.architecture"] == f"flux-1-{variant}/lora"
    assert meta["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"


@pytest.mark.parametrize(
    "fam, parameterization, version, architecture",
    [
        (family.SD1, "eps", "sd_v1", "stable-diffusion-v1/lora"),
        (family.SD2, "v", "sd_v2_v", "stable-diffusion-v2-768-v/lora"),
        (family.SD2, "eps", "sd_v2", "stable-diffusion-v2-512/lora"),
        (family.SDXL, "eps", "sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
    ],
)
def test_unet_families_keep_kohyas_versions(fam, parameterization, version, architecture):
    meta = base_model_metadata(fam, [], parameterization)
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (
        version,
        architecture,
    )
