"""UNetModel / attention: original checkpoint layout, parity with diffusers, checkpointing."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ldm.attention import CrossAttention, attention
from ldm.unet import UNetModel, timestep_embedding
from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"  # key -> shape lists of the original checkpoints
PREFIX = "model.diffusion_model."

# Reduced-width versions of the two original UNet configs: attention at both levels.
TINY_V1 = dict(
    image_size=32,
    in_channels=4,
    out_channels=4,
    model_channels=32,
    attention_resolutions=[2, 1],
    num_res_blocks=1,
    channel_mult=[1, 2],
    num_heads=4,
    use_spatial_transformer=True,
    transformer_depth=1,
    context_dim=32,
    use_checkpoint=True,
    legacy=False,
)
TINY_V2 = dict(
    use_checkpoint=True,
    use_fp16=True,
    image_size=32,
    in_channels=4,
    out_channels=4,
    model_channels=32,
    attention_resolutions=[2, 1],
    num_res_blocks=2,
    channel_mult=[1, 2],
    num_head_channels=16,
    use_spatial_transformer=True,
    use_linear_in_transformer=True,
    transformer_depth=2,
    context_dim=32,
    legacy=False,
)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere: the zero-initialised output convs would hide wiring errors."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            std = 0.1 if param.dim() == 1 else param[0].numel() ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def inputs(batch=2, height=8, width=12, context_len=7, context_dim=32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, height, width, generator=generator)
    timesteps = torch.tensor([3.0, 917.0])[:batch]
    context = torch.randn(batch, context_len, context_dim, generator=generator)
    return x, timesteps, {"crossattn": context}


@pytest.mark.parametrize(
    "config_name, keys_name",
    [
        ("v1-inference", "sd_v1_keys"),
        ("v2-inference", "sd_v2_base_keys"),
        ("v2-inference-v", "sd_v2_v_keys"),
    ],
)
def test_original_config_builds_the_original_state_dict(config_name, keys_name):
    config = OmegaConf.load(ROOT / "configs" / "stable-diffusion" / f"{config_name}.yaml")
    with torch.device("meta"):  # full size, no memory
        unet = instantiate_from_config(config.model.params.unet_config)
    assert isinstance(unet, UNetModel)
    reference = json.loads((REFERENCE / f"{keys_name}.json").read_text())["keys"]
    expected = {k[len(PREFIX) :]: v for k, v in reference.items() if k.startswith(PREFIX)}
    ours = {name: list(t.shape) for name, t in unet.state_dict().items()}
    assert sorted(ours) == sorted(expected)
    assert ours == expected


@pytest.mark.parametrize("params", [TINY_V1, TINY_V2], ids=["v1", "v2"])
@pytest.mark.parametrize("num_classes", [None, 5], ids=["text", "class"])
def test_matches_diffusers_unet(params, num_classes):
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    params = dict(params, num_classes=num_classes) if num_classes else params
    ours = randomize_(UNetModel(**params)).eval()
    checkpoint = {PREFIX + k: v for k, v in ours.state_dict().items()}
    original_config = {
        "model": {
            "params": {
                "unet_config": {"params": params},
                "first_stage_config": {"params": {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}},
            }
        }
    }
    config = create_unet_diffusers_config_from_ldm(original_config, checkpoint)
    theirs = UNet2DConditionModel(**config).eval()
    theirs.load_state_dict(convert_ldm_unet_checkpoint(checkpoint, config), strict=True)

    x, timesteps, cond = inputs()
    labels = torch.tensor([0, 3]) if num_classes else None
    with torch.no_grad():
        expected = theirs(x, timesteps, cond["crossattn"], class_labels=labels).sample
        cond = {**cond, **({"y": labels} if num_classes else {})}
        actual = ours(x, timesteps, cond)
    assert actual.shape == x.shape
    assert expected.abs().mean() > 0.01  # a real signal, not the zero-init output conv
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_timestep_embedding_matches_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding

    timesteps = torch.tensor([0.0, 1.0, 250.5, 999.0])
    expected = get_timestep_embedding(timesteps, 320, flip_sin_to_cos=True, downscale_freq_shift=0)
    torch.testing.assert_close(timestep_embedding(timesteps, 320), expected)


def test_head_layout_follows_num_heads_num_head_channels_and_legacy():
    def heads_and_proj_in(**kwargs):
        params = dict(TINY_V1, channel_mult=[1, 3], attention_resolutions=[2], num_heads=-1)
        params.update(kwargs)
        with torch.device("meta"):
            unet = UNetModel(**params)
        transformer = unet.input_blocks[3][1]  # level 1: 96 channels
        attn = transformer.transformer_blocks[0].attn1
        return attn.heads, tuple(transformer.proj_in.weight.shape[:2])  # (heads, (inner, C))

    # 96 channels, 64 channels per head -> 1 head of 64; legacy: dim_head = 96 // 1 heads.
    assert heads_and_proj_in(num_head_channels=64) == (1, (64, 96))
    assert heads_and_proj_in(num_head_channels=64, legacy=True) == (1, (96, 96))
    assert heads_and_proj_in(num_heads=8, num_head_channels=-1) == (8, (96, 96))


def grads_after_step(unet, x, timesteps, context):
    unet.zero_grad(set_to_none=True)
    unet(x, timesteps, context).square().mean().backward()
    return {name: p.grad.clone() for name, p in unet.named_parameters()}


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients():
    unet = randomize_(UNetModel(**dict(TINY_V1, use_checkpoint=False))).train()
    x, timesteps, context = inputs()
    calls = []
    unet.middle_block[0].register_forward_hook(lambda *_: calls.append(1))

    plain = grads_after_step(unet, x, timesteps, context)
    assert len(calls) == 1
    unet.set_gradient_checkpointing(True)
    checkpointed = grads_after_step(unet, x, timesteps, context)
    assert len(calls) == 3  # forward + recomputation during backward
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)

    calls.clear()
    with torch.no_grad():  # no recomputation outside training with gradients
        unet(x, timesteps, context)
    unet.eval()
    unet(x, timesteps, context).sum().backward()
    assert len(calls) == 2


def test_xformers_backend_missing_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)  # makes `import xformers` fail
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with pytest.raises(ImportError, match="pip install xformers"):
        UNetModel(**dict(TINY_V1, attention_backend="xformers"))
    with pytest.raises(ValueError, match="attention_backend"):
        UNetModel(**dict(TINY_V1, attention_backend="flash"))


def test_attention_matches_the_softmax_formula_and_upcast_keeps_fp32_results():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4 * 8, generator=generator) for n in (10, 6, 6))
    heads = [t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k, v)]
    weights = (heads[0] @ heads[1].transpose(-1, -2) / 8**0.5).softmax(-1)
    expected = (weights @ heads[2]).transpose(1, 2).flatten(2)
    torch.testing.assert_close(attention(q, k, v, heads=4), expected)
    torch.testing.assert_close(attention(q, k, v, heads=4, upcast=True), expected)

    # bf16 inputs: upcast computes in float32 and only rounds the result.
    low = [t.bfloat16() for t in (q, k, v)]
    exact = attention(*[t.float() for t in low], heads=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        upcast = attention(*low, heads=4, upcast=True)
    assert upcast.dtype == torch.bfloat16
    torch.testing.assert_close(upcast, exact.bfloat16(), atol=0, rtol=0)


def test_upcast_attention_model_gives_the_same_fp32_output():
    x, timesteps, context = inputs()
    plain = randomize_(UNetModel(**TINY_V2)).eval()
    upcast = UNetModel(**dict(TINY_V2, upcast_attention=True)).eval()
    upcast.load_state_dict(plain.state_dict())
    layers = [m for m in upcast.modules() if isinstance(m, CrossAttention)]
    assert len(layers) == 44 and all(layer.upcast for layer in layers)  # 11 transformers x 2 x 2
    with torch.no_grad():
        torch.testing.assert_close(upcast(x, timesteps, context), plain(x, timesteps, context))


def test_cross_attention_uses_the_context():
    torch.manual_seed(0)
    layer = CrossAttention(16, context_dim=8, heads=2, dim_head=8)
    x = torch.randn(1, 5, 16)
    out_a = layer(x, torch.randn(1, 3, 8))
    out_b = layer(x, torch.randn(1, 3, 8))
    assert out_a.shape == (1, 5, 16)
    assert not torch.allclose(out_a, out_b)


def test_invalid_configurations_fail_clearly():
    with pytest.raises(ValueError, match="use_spatial_transformer"):
        UNetModel(**dict(TINY_V1, use_spatial_transformer=False))
    with pytest.raises(ValueError, match="num_heads or num_head_channels"):
        UNetModel(**dict(TINY_V1, num_heads=-1))
    with pytest.raises(ValueError, match="32-channel transformer cannot have heads of 64"):
        UNetModel(**dict(TINY_V1, num_heads=-1, num_head_channels=64))
    with pytest.raises(TypeError, match="unknown_key"):
        UNetModel(**dict(TINY_V1, unknown_key=1))
    unet = UNetModel(**TINY_V1)
    x, timesteps, context = inputs()
    with pytest.raises(ValueError, match="num_classes"):
        unet(x, timesteps, {**context, "y": torch.tensor([0, 1])})


def test_half_precision_model_runs_without_autocast():
    unet = randomize_(UNetModel(**TINY_V1)).eval().to(torch.bfloat16)
    x, timesteps, context = inputs()
    with torch.no_grad():
        out = unet(x.bfloat16(), timesteps, {"crossattn": context["crossattn"].bfloat16()})
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (
        F.mse_loss(out.float(), randomize_(UNetModel(**TINY_V1)).eval()(x, timesteps, context))
        < 1e-3
    )


def test_channels_last_weights_give_the_same_output():
    # Nothing in the UNet forces NCHW: `unet.to(memory_format=torch.channels_last)` (faster for
    # bf16 / fp16 convs) runs the whole network channels-last with unchanged results.
    unet = randomize_(UNetModel(**TINY_V1)).eval()
    x, timesteps, context = inputs()
    with torch.no_grad():
        expected = unet(x, timesteps, context)
        unet.to(memory_format=torch.channels_last)
        layouts = []
        unet.output_blocks[-1].register_forward_hook(
            lambda _m, _i, out: layouts.append(out.is_contiguous(memory_format=torch.channels_last))
        )
        actual = unet(x, timesteps, context)
    assert layouts == [True]  # the activations stayed channels-last to the last block
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)
