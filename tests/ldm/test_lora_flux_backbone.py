"""LoRA on a Flux.1 backbone through ldm.lora (no Flux config ships yet: a LatentDiffusion of
configs/sd3/tiny.yaml with ldm.flux.Flux as its backbone): `add_adapters` puts adapters on every
Linear of the double and single blocks (kohya sd-scripts networks/lora_flux.py's default), the
kohya file names them `lora_unet_` + BFL module with `.` -> `_`, and the diffusers file, loaded
by diffusers' own `load_lora_adapter` into a FluxTransformer2DModel with our base weights
(diffusers' converter), gives our output; our kohya file merges back into peft's merge."""

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ldm import lora
from ldm.flux import Flux
from ldm.util import instantiate_from_config

pytest.importorskip("peft")
pytest.importorskip("diffusers")
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402
from flux_helpers import ours_and_diffusers, tiny_converter  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "tiny.yaml"
FLUX = dict(depth=1, depth_single_blocks=1, hidden_size=48, num_heads=2, in_channels=16,
            context_dim=48, pooled_dim=40, axes_dim=(4, 10, 10), guidance_embed=False)  # fmt: skip
RANK, ALPHA = 4, 8.0  # scale 2


@pytest.fixture(scope="module")
def model():
    cfg = OmegaConf.load(TINY).model
    cfg.params.backbone_config = {"target": "ldm.flux.Flux", "params": FLUX}
    cfg.params.lora = {"rank": RANK, "alpha": ALPHA}
    model = instantiate_from_config(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.backbone.named_parameters():
            param.copy_(0.1 * torch.randn_like(param) + name.endswith(".scale"))
    return model


def base_state(model) -> dict:
    return {
        n.replace(".base_layer", ""): p.detach().clone()
        for n, p in model.backbone.state_dict().items()
        if "lora_" not in n
    }


def test_adapters_on_every_block_linear_and_kohya_names(model):
    plain = Flux(**FLUX)
    linears = [
        n
        for n, m in plain.named_modules()
        if isinstance(m, nn.Linear) and n.startswith(("double_blocks.", "single_blocks."))
    ]
    assert set(lora.adapter_layers(model.backbone)) == set(linears)
    state = lora.kohya_state_dict(model)
    assert {k.removesuffix(".lora_down.weight") for k in state if "lora_down" in k} == {
        "lora_unet_" + n.replace(".", "_") for n in linears
    }
    layer = model.backbone.double_blocks[0].img_attn.qkv
    assert torch.equal(
        state["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"],
        layer.lora_B["default"].weight,
    )
    assert float(state["lora_unet_single_blocks_0_linear1.alpha"]) == ALPHA


def test_diffusers_file_through_diffusers_loader_gives_our_output(model):
    theirs = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=24,
        num_attention_heads=2, joint_attention_dim=48, pooled_projection_dim=40,
        guidance_embeds=False, axes_dims_rope=(4, 10, 10),
    ).eval()  # fmt: skip
    theirs.load_state_dict(tiny_converter(48)(base_state(model)), strict=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    theirs.load_lora_adapter(
        FluxPipeline.lora_state_dict(lora.diffusers_state_dict(model)), prefix="transformer"
    )
    mine, adapted, _ = ours_and_diffusers(model, theirs)
    torch.testing.assert_close(mine, adapted, rtol=1e-4, atol=1e-5)

    merged, plain = copy.deepcopy(model), copy.deepcopy(model)
    lora.merge_adapters(merged)
    lora._unload(plain)
    from_diffusers = copy.deepcopy(plain)
    assert lora.merge_file(plain, lora.kohya_state_dict(model)) == 13  # double block: 10, single: 3
    # diffusers' format (split q/k/v, transformer.* names) merges to the same weights
    assert lora.merge_file(from_diffusers, lora.diffusers_state_dict(model)) == 13
    for k, v in merged.backbone.state_dict().items():
        torch.testing.assert_close(plain.backbone.state_dict()[k], v, msg=k)
        torch.testing.assert_close(from_diffusers.backbone.state_dict()[k], v, msg=k)
