"""Diffusers-format SD3 / Flux LoRA files read back as kohya state dicts
(ldm.layout.kohya_sd3/kohya_flux `kohya_from_diffusers`), against diffusers' own code:

- A LoRA made and saved by diffusers (peft adapters on the diffusers transformer, each q / k / v
  with its own lora_A, some parts left out, alpha != rank and an alpha_pattern, written by the
  pipeline's own `save_lora_weights` with its metadata): our kohya reader merges the converted
  file into our model to the weights diffusers' own `fuse_lora` gives its transformer (mapped by
  diffusers' single-file converter).
- Our own diffusers export (one lora_A shared by q, k, v) read back: the rank stays and every
  layer's update is our kohya file's. (diffusers' own kohya converter for Flux cuts `linear1` at
  the released width 3072, so it cannot read a tiny model's file.)
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ldm.layout import kohya_flux, kohya_sd3
from ldm.mmdit import MMDiT
from ldm.mmdit import lora_targets as mmdit_targets

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffusers import FluxPipeline, SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402
from diffusers.loaders.single_file_utils import (  # noqa: E402
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from flux_helpers import tiny_converter, tiny_pair  # noqa: E402
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from ldm.flux import lora_targets as flux_targets  # noqa: E402

SD3_TINY = dict(depth=3, hidden_size=64, num_heads=2, in_channels=4, context_dim=24,
                pooled_dim=16, pos_embed_max_size=8, sample_size=8, qk_norm=True,
                dual_attention_layers=(0,))  # fmt: skip


def sd3_pair():
    torch.manual_seed(0)
    ours = MMDiT(**SD3_TINY)
    with torch.no_grad():
        for tensor in ours.parameters():
            tensor.add_(torch.randn_like(tensor) * 0.1)
    theirs = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
        attention_head_dim=32, num_attention_heads=2, joint_attention_dim=24,
        caption_projection_dim=64, pooled_projection_dim=16, pos_embed_max_size=8,
        qk_norm="rms_norm", dual_attention_layers=(0,),
    )  # fmt: skip
    theirs.load_state_dict(sd3_convert(ours.state_dict()), strict=True)
    return ours, theirs


def sd3_convert(state):
    return convert_sd3_transformer_checkpoint_to_diffusers(
        {"model.diffusion_model." + k: v for k, v in state.items()}
    )


# diffusers' module names LoRA trainers target; add_k_proj / proj_mlp left out (zero rows).
SD3_TARGETS = r".*transformer_blocks\.\d+\.(attn2?\.(to_q|to_k|to_v|to_out\.0)|attn\.(add_q_proj|add_v_proj|to_add_out)|ff(_context)?\.net\.(0\.proj|2))"
FLUX_TARGETS = r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|ff(_context)?\.net\.(0\.proj|2)|proj_out)"

FAMILIES = {  # (our / diffusers pair, diffusers' converter, pipeline, layout, our targets, theirs)
    "sd3": (sd3_pair, sd3_convert, StableDiffusion3Pipeline, kohya_sd3, mmdit_targets, SD3_TARGETS),
    "flux": (
        lambda: tiny_pair(),
        lambda state: tiny_converter(48)(dict(state)),
        FluxPipeline,
        kohya_flux,
        flux_targets,
        FLUX_TARGETS,
    ),
}


def merge_kohya(model, layout, targets, kohya_state):
    """kohya's rule, W += alpha / rank * up @ down, on the adapters our reader finds."""
    adapters = layout.from_kohya(kohya_state, targets(model))
    assert adapters, "nothing read"
    modules = dict(model.named_modules())
    with torch.no_grad():
        for module, (down, up, alpha) in adapters.items():
            modules[module].weight += alpha / down.shape[0] * up.float() @ down.float()
    return model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_lora_diffusers_trained_and_saved_merges_as_diffusers_fuses_it(name, tmp_path):
    pair, convert, pipeline, layout, targets, their_targets = FAMILIES[name]
    ours, theirs = pair()
    config = LoraConfig(
        r=4,
        lora_alpha=6,
        alpha_pattern={"to_k": 2},  # peft's per-module alpha, stored in the file's metadata
        target_modules=their_targets,
        init_lora_weights="gaussian",
    )
    theirs.add_adapter(config)
    torch.manual_seed(3)
    with torch.no_grad():  # every A its own, every B non-zero (a fresh B is zero)
        for param_name, param in theirs.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn_like(param) * 0.2)
    pipeline.save_lora_weights(
        tmp_path,
        transformer_lora_layers=get_peft_model_state_dict(theirs),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    file = tmp_path / "pytorch_lora_weights.safetensors"
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    kohya_state = layout.kohya_from_diffusers(load_file(file), metadata)

    theirs.fuse_lora()  # diffusers' own merge
    theirs.unload_lora()
    merge_kohya(ours, layout, targets, kohya_state)
    expected, got = theirs.state_dict(), convert(ours.state_dict())
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_our_diffusers_export_reads_back_as_our_kohya_file(name, tmp_path):
    """Our export shares one lora_A between q, k and v: read back, the rank stays (no
    block-diagonal copy) and every layer's update is the kohya file's."""
    pair, _, _, layout, targets, _ = FAMILIES[name]
    ours = pair()[0]
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets(ours)), ours)
    torch.manual_seed(2)
    with torch.no_grad():
        for param_name, param in ours.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn_like(param) * 0.2)
    adapters = layout.peft_adapters(ours)
    save_file(layout.to_diffusers(adapters), tmp_path / "lora.safetensors")
    back = layout.kohya_from_diffusers(load_file(tmp_path / "lora.safetensors"))
    reread = layout.from_kohya(back, adapters)
    assert set(reread) == set(adapters)
    for module, (down, up, alpha) in adapters.items():
        down2, up2, alpha2 = reread[module]
        assert down2.shape == down.shape  # the shared lora_A kept: the rank is not tripled
        torch.testing.assert_close(
            alpha2 / down2.shape[0] * up2 @ down2, alpha / down.shape[0] * up @ down
        )


def test_a_key_for_another_model_is_one_clear_error():
    state = {"transformer.x_embedder.lora_A.weight": torch.zeros(4, 8)}
    with pytest.raises(ValueError, match=r"x_embedder.*no Linear layer of this SD3 model"):
        kohya_sd3.kohya_from_diffusers(state)
