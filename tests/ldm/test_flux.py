"""Flux.1 (ldm.flux) against code we did not write: diffusers' Flux single-file converter, its
FluxTransformer2DModel, its FluxPipeline's packing / position ids / shift, and BFL's formulas.

Full size: each preset is built on the meta device; diffusers' converter (untouched) must consume
every key of our state dict and produce exactly the keys and shapes of FluxTransformer2DModel
built from the released model's diffusers config.
Tiny size: random non-zero weights converted into a tiny FluxTransformer2DModel give the same
output and the same gradient of the inputs and of every parameter. diffusers' converter hard-codes
the released width (`inner_dim = 3072`) where it splits `single_blocks.N.linear1`; for the tiny
model we run its own source with that one constant set to the tiny width (`tiny_converter`).
"""

import math

import pytest
import torch

from ldm import flow
from ldm.flux import Flux, flux1_dev, flux1_schnell, flux_shift, image_seq_len, rope
from ldm.layout import flux as layout

diffusers = pytest.importorskip("diffusers")
single_file_utils = pytest.importorskip("diffusers.loaders.single_file_utils")
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # noqa: E402
from flux_helpers import TINY, convert, diffusers_forward, tiny_converter, tiny_pair  # noqa: E402

# transformer/config.json of black-forest-labs/FLUX.1-dev and FLUX.1-schnell
_COMMON = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    axes_dims_rope=(16, 56, 56),
)
DIFFUSERS_CONFIGS = {
    "dev": dict(_COMMON, guidance_embeds=True),
    "schnell": dict(_COMMON, guidance_embeds=False),
}
PRESETS = {"dev": flux1_dev, "schnell": flux1_schnell}


@pytest.mark.parametrize("variant", sorted(PRESETS))
def test_full_size_state_dict_is_bfl_single_file(variant):
    with torch.device("meta"):
        ours = PRESETS[variant]()
        theirs = FluxTransformer2DModel(**DIFFUSERS_CONFIGS[variant])
    checkpoint = layout.to_bfl_file(ours.state_dict())
    assert layout.is_flux(checkpoint) and layout.variant(checkpoint) == variant
    model_type = single_file_utils.infer_diffusers_model_type(checkpoint)
    assert model_type == f"flux-{variant}"
    converted = convert(checkpoint)
    # The converter pops every key it reads: anything left is a key BFL's layout lacks.
    assert not checkpoint, f"keys diffusers' converter does not know: {sorted(checkpoint)[:5]}"
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in converted.items()}
    assert sorted(set(expected) - set(got)) == [], "missing"
    assert sorted(set(got) - set(expected)) == [], "unexpected"
    assert {k: v for k, v in got.items() if expected[k] != v} == {}, "shape mismatch"


def test_preset_sizes():
    """Flux.1 is a 12B transformer (11.9e9 parameters in flux1-dev.safetensors)."""
    with torch.device("meta"):
        dev = sum(p.numel() for p in flux1_dev().parameters())
        schnell = sum(p.numel() for p in flux1_schnell().parameters())
    assert round(dev / 1e9, 1) == 11.9
    assert dev - schnell == 256 * 3072 + 3072 + 3072 * 3072 + 3072  # guidance_in only


def test_checkpoint_prefix_round_trip():
    model = Flux(**TINY)
    file = layout.to_bfl_file(model.state_dict())
    assert "double_blocks.0.img_attn.norm.query_norm.scale" in file
    checkpoint = layout.to_checkpoint(file)
    assert all(k.startswith("model.diffusion_model.") for k in checkpoint)
    assert layout.strip_prefix(checkpoint).keys() == file.keys()
    Flux(**TINY).load_state_dict(layout.strip_prefix(checkpoint), strict=True)


# --- the image-size-dependent shift --------------------------------------------------------------


@pytest.mark.parametrize("side", [256, 512, 768, 1024, 1360])
def test_flux_shift_is_bfl_time_shift(side):
    """BFL get_schedule: t' = exp(mu) / (exp(mu) + (1/t - 1)), mu from diffusers' calculate_shift
    (the same line as BFL's get_lin_function) for the image's token count."""
    seq = image_seq_len(side // 8, side // 8)
    assert seq == (side // 16) ** 2
    mu = calculate_shift(seq)
    t = torch.linspace(0.01, 1.0, 50, dtype=torch.float64)
    bfl = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    torch.testing.assert_close(flow.shift_time(t, flux_shift(seq)), bfl, rtol=1e-12, atol=1e-12)
    if side == 1024:
        assert flux_shift(seq) == pytest.approx(math.exp(1.15))


# --- tiny numerical parity ---------------------------------------------------------------------


# batch 1: one modulation for the batch, which ldm.flux folds into the LayerNorm's affine map
@pytest.mark.parametrize(("variant", "batch"), [("dev", 2), ("schnell", 2), ("dev", 1)])
def test_tiny_matches_diffusers_forward_and_every_gradient(variant, batch):
    ours, theirs = tiny_pair(guidance=variant == "dev")
    torch.manual_seed(1)
    # not square: rows and columns get different RoPE angles
    x, context = torch.randn(batch, 4, 12, 8), torch.randn(batch, 5, 20)
    pooled, t = torch.randn(batch, 12), torch.rand(batch) * 1000
    guidance = torch.tensor([3.5, 1.0])[:batch] if variant == "dev" else None
    ours_in = [v.clone().requires_grad_() for v in (x, context, pooled)]
    theirs_in = [v.clone().requires_grad_() for v in (x, context, pooled)]
    cond = {"crossattn": ours_in[1], "vector": ours_in[2]}
    if guidance is not None:
        cond["guidance"] = guidance

    out = ours(ours_in[0], t, cond)
    ref = diffusers_forward(theirs, *theirs_in[:1], t, *theirs_in[1:], guidance=guidance)
    assert out.shape == x.shape
    out_packed = FluxPipeline._pack_latents(out, *x.shape)
    assert ref.abs().mean() > 0.05  # a real signal
    torch.testing.assert_close(out_packed, ref, rtol=1e-4, atol=1e-5)

    weight = torch.randn_like(ref)
    (out_packed * weight).sum().backward()
    (ref * weight).sum().backward()
    for name, a, b in zip(("x", "crossattn", "vector"), ours_in, theirs_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    convert_tiny = tiny_converter(TINY["hidden_size"])
    ours_grads = convert_tiny({k: p.grad for k, p in ours.named_parameters()})
    theirs_grads = {k: p.grad for k, p in theirs.named_parameters()}
    assert set(ours_grads) == set(theirs_grads)
    for name, grad in theirs_grads.items():
        atol = 1e-5 * grad.abs().max().item()
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=atol, msg=name)


def test_guidance_changes_dev_output_and_default_guidance():
    ours, _ = tiny_pair(guidance=True)
    x, t = torch.randn(1, 4, 4, 4), torch.tensor([500.0])
    cond = {"crossattn": torch.randn(1, 3, 20), "vector": torch.randn(1, 12)}
    low = ours(x, t, cond | {"guidance": torch.tensor([1.0])})
    high = ours(x, t, cond | {"guidance": torch.tensor([4.0])})
    assert (low - high).abs().max() > 1e-3
    ours.guidance = 4.0  # the backbone's default when the conditioner gives none
    torch.testing.assert_close(ours(x, t, cond), high, rtol=0, atol=0)


def test_gradient_checkpointing_keeps_output_and_gradients():
    ours, _ = tiny_pair()
    ours.train()
    x = torch.randn(2, 4, 8, 8)
    cond = {"crossattn": torch.randn(2, 3, 20), "vector": torch.randn(2, 12), "guidance": 3.5}
    t = torch.rand(2) * 1000
    results = []
    for enabled in (False, True):
        ours.zero_grad()
        ours.set_gradient_checkpointing(enabled)
        out = ours(x, t, cond)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in ours.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for plain, checkpointed in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-6, atol=1e-7)


def test_fresh_model_starts_as_zero_output():
    model = Flux(**TINY)
    out = model(
        torch.randn(1, 4, 8, 8),
        torch.tensor([500.0]),
        {"crossattn": torch.randn(1, 3, 20), "vector": torch.randn(1, 12), "guidance": 3.5},
    )
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(model.double_blocks[0].img_attn.qkv.weight) > 0


def test_bad_input_is_one_clear_error():
    model = Flux(**TINY)
    cond = {"crossattn": torch.randn(1, 3, 20), "vector": torch.randn(1, 12)}
    with pytest.raises(ValueError, match="guidance"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1.0]), cond)
    with pytest.raises(ValueError, match="'vector'"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1.0]), {"crossattn": cond["crossattn"]})
    with pytest.raises(ValueError, match="multiples of the patch size"):
        model(torch.randn(1, 4, 7, 8), torch.tensor([1.0]), cond | {"guidance": 1.0})
    with pytest.raises(ValueError, match="axes_dim"):
        Flux(**TINY | {"axes_dim": (4, 8, 8)})


def test_complex_rope_compiles_to_the_eager_output_and_gradients():
    """The RoPE is a complex multiply (`view_as_complex`): torch.compile must trace it whole
    (fullgraph, AOTAutograd's forward and backward graphs, backend "aot_eager") and give eager's
    output and gradients, through a double and a single block. Eager itself is held to
    diffusers' real-valued RoPE above."""
    torch._dynamo.reset()
    model, _ = tiny_pair()
    double, single = model.double_blocks[0], model.single_blocks[0]

    def blocks(img, txt, vec, ids):
        rotation = rope(ids, model.axes_dim, model.theta)
        img, txt = double(img, txt, vec, rotation)
        return single(torch.cat([txt, img], dim=1), vec, rotation)

    torch.manual_seed(2)
    img, txt, vec = torch.randn(1, 6, 48), torch.randn(1, 3, 48), torch.randn(1, 48)
    ids = Flux.position_ids(1, 3, 6, 4)
    results = []
    for run in (blocks, torch.compile(blocks, backend="aot_eager", fullgraph=True)):
        model.zero_grad()
        out = run(img, txt, vec, ids)
        out.square().sum().backward()
        results.append(
            (out.detach(), [p.grad.clone() for p in (*double.parameters(), *single.parameters())])
        )
    assert (results[0][0] - torch.cat([txt, img], dim=1)).abs().mean() > 0.05  # blocks at work
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    for plain, traced in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(traced, plain, rtol=1e-5, atol=1e-6)
