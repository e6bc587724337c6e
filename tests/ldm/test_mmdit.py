"""MMDiT (ldm.mmdit) against code we did not write: diffusers' SD3 single-file converter and its
SD3Transformer2DModel.

Full size: each preset is built on the meta device (nothing allocated); diffusers' converter must
consume every key of our `model.diffusion_model.` state dict and produce exactly the keys and
shapes of SD3Transformer2DModel built from the released model's diffusers config.
Tiny size: random non-zero weights (so adaLN-Zero hides nothing) converted into a tiny
SD3Transformer2DModel give the same output, the same input gradients and the same gradient of
every parameter.
"""

import pytest
import torch
import torch.nn.functional as F

from ldm.mmdit import MMDiT, QKNorm, sd3_medium, sd3_pos_embed, sd35_large, sd35_medium

diffusers = pytest.importorskip("diffusers")
single_file_utils = pytest.importorskip("diffusers.loaders.single_file_utils")
from diffusers import SD3Transformer2DModel  # noqa: E402
from diffusers.models.embeddings import get_2d_sincos_pos_embed  # noqa: E402

convert = single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers
PREFIX = "model.diffusion_model."

# The transformer/config.json of the released diffusers repositories
# (stabilityai/stable-diffusion-3-medium-diffusers, stable-diffusion-3.5-medium, -3.5-large).
_SD3_COMMON = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    attention_head_dim=64,
    joint_attention_dim=4096,
    pooled_projection_dim=2048,
)
DIFFUSERS_CONFIGS = {
    "sd3_medium": dict(
        _SD3_COMMON,
        num_layers=24,
        num_attention_heads=24,
        caption_projection_dim=1536,
        pos_embed_max_size=192,
    ),
    "sd35_medium": dict(
        _SD3_COMMON,
        num_layers=24,
        num_attention_heads=24,
        caption_projection_dim=1536,
        pos_embed_max_size=384,
        qk_norm="rms_norm",
        dual_attention_layers=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
    ),
    "sd35_large": dict(
        _SD3_COMMON,
        num_layers=38,
        num_attention_heads=38,
        caption_projection_dim=2432,
        pos_embed_max_size=192,
        qk_norm="rms_norm",
    ),
}
PRESETS = {"sd3_medium": sd3_medium, "sd35_medium": sd35_medium, "sd35_large": sd35_large}
# What diffusers' single-file loader calls each file (infer_diffusers_model_type).
DIFFUSERS_MODEL_TYPES = {
    "sd3_medium": "sd3",
    "sd35_medium": "sd35_medium",
    "sd35_large": "sd35_large",
}


def original_state_dict(model: MMDiT, grads: bool = False) -> dict[str, torch.Tensor]:
    """Our weights (or their gradients) as a Stability single file names them."""
    if grads:  # the position table is a buffer; the converter still wants one
        return {PREFIX + "pos_embed": model.pos_embed} | {
            PREFIX + k: p.grad for k, p in model.named_parameters()
        }
    return {PREFIX + k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_full_size_state_dict_is_the_single_file_layout(preset):
    with torch.device("meta"):
        ours = PRESETS[preset]()
        theirs = SD3Transformer2DModel(**DIFFUSERS_CONFIGS[preset])
    checkpoint = original_state_dict(ours)
    assert single_file_utils.infer_diffusers_model_type(checkpoint) == DIFFUSERS_MODEL_TYPES[preset]
    converted = convert(checkpoint)
    # The converter pops every key it reads: anything left is a key the SD3 layout lacks.
    assert not checkpoint, f"keys diffusers' converter does not know: {sorted(checkpoint)[:5]}"
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in converted.items()}
    assert sorted(set(expected) - set(got)) == [], "missing"
    assert sorted(set(got) - set(expected)) == [], "unexpected"
    assert {k: v for k, v in got.items() if expected[k] != v} == {}, "shape mismatch"


def test_preset_sizes():
    """The numbers the model cards give: 2B / 2.5B / 8B parameters (the table included)."""
    with torch.device("meta"):
        sizes = {
            name: sum(t.numel() for t in make().state_dict().values())
            for name, make in PRESETS.items()
        }
    assert round(sizes["sd3_medium"] / 1e9, 1) == 2.1
    assert round(sizes["sd35_medium"] / 1e9, 1) == 2.5
    assert round(sizes["sd35_large"] / 1e9, 1) == 8.1


def test_pos_embed_is_diffusers_table():
    ours = sd3_pos_embed(64, 12, 4)
    theirs = get_2d_sincos_pos_embed(64, 12, base_size=4, output_type="pt").float()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # and a fresh model's table is the one a fresh diffusers model of the same config makes
    _, theirs_model = tiny_pair("sd3", randomise=False)
    torch.testing.assert_close(
        MMDiT(**TINY).pos_embed, theirs_model.pos_embed.pos_embed, rtol=0, atol=1e-6
    )


# --- tiny numerical parity ---------------------------------------------------------------------

TINY = dict(
    depth=3,
    hidden_size=64,
    num_heads=2,
    in_channels=4,
    context_dim=24,
    pooled_dim=16,
    pos_embed_max_size=8,
    sample_size=8,
)
VARIANTS = {  # ours, diffusers' extra config
    "sd3": (dict(), dict()),
    "sd35_large": (dict(qk_norm=True), dict(qk_norm="rms_norm")),
    "sd35_medium": (
        dict(qk_norm=True, dual_attention_layers=(0, 1)),
        dict(qk_norm="rms_norm", dual_attention_layers=(0, 1)),
    ),
}


def tiny_pair(variant: str, randomise: bool = True) -> tuple[MMDiT, SD3Transformer2DModel]:
    """A tiny MMDiT and a tiny SD3Transformer2DModel; with randomise, ours gets random non-zero
    weights and diffusers' converter copies them into theirs."""
    ours_extra, theirs_extra = VARIANTS[variant]
    torch.manual_seed(0)
    ours = MMDiT(**TINY, **ours_extra)
    if randomise:  # non-zero everywhere: adaLN-Zero would hide the blocks
        with torch.no_grad():
            for name, tensor in [*ours.named_parameters(), *ours.named_buffers()]:
                # RMSNorm scales about 1 so the attention logits stay large enough to matter.
                tensor.copy_(torch.randn_like(tensor) * 0.1 + (".ln_" in name))
    theirs = SD3Transformer2DModel(
        sample_size=TINY["sample_size"],
        patch_size=2,
        in_channels=TINY["in_channels"],
        out_channels=TINY["in_channels"],
        num_layers=TINY["depth"],
        attention_head_dim=TINY["hidden_size"] // TINY["num_heads"],
        num_attention_heads=TINY["num_heads"],
        joint_attention_dim=TINY["context_dim"],
        caption_projection_dim=TINY["hidden_size"],
        pooled_projection_dim=TINY["pooled_dim"],
        pos_embed_max_size=TINY["pos_embed_max_size"],
        **theirs_extra,
    )
    if randomise:
        theirs.load_state_dict(convert(original_state_dict(ours)), strict=True)
    return ours, theirs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_matches_diffusers_forward_and_every_gradient(variant):
    ours, theirs = tiny_pair(variant)
    torch.manual_seed(1)
    # Not square and smaller than the table (6 x 4 patches of 8 x 8): the crop is exercised.
    x = torch.randn(2, 4, 12, 8)
    t = torch.rand(2) * 1000
    context = torch.randn(2, 5, TINY["context_dim"])
    pooled = torch.randn(2, TINY["pooled_dim"])
    inputs_ours = [v.clone().requires_grad_() for v in (x, context, pooled)]
    inputs_theirs = [v.clone().requires_grad_() for v in (x, context, pooled)]

    out = ours(inputs_ours[0], t, {"crossattn": inputs_ours[1], "vector": inputs_ours[2]})
    ref = theirs(
        hidden_states=inputs_theirs[0],
        encoder_hidden_states=inputs_theirs[1],
        pooled_projections=inputs_theirs[2],
        timestep=t,
        return_dict=False,
    )[0]
    assert out.shape == ref.shape == x.shape
    assert ref.abs().mean() > 0.05  # a real signal, not a zero output
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)

    weight = torch.randn_like(out)  # a loss that weighs every output element differently
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for name, ours_in, theirs_in in zip(("x", "crossattn", "vector"), inputs_ours, inputs_theirs):
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-4, atol=1e-5, msg=name)
    # Gradients map like the weights: convert ours and compare to diffusers' parameter grads.
    ours_grads = convert(original_state_dict(ours, grads=True))
    del ours_grads["pos_embed.pos_embed"]
    theirs_grads = {k: p.grad for k, p in theirs.named_parameters()}
    assert set(ours_grads) == set(theirs_grads)
    for name, grad in theirs_grads.items():
        # fp32 sums in another order: tolerance relative to the tensor's largest entry
        atol = 1e-5 * grad.abs().max().item()
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=atol, msg=name)


# torch warns that a bf16 input with an fp32 weight skips its fused kernel: the reference is fine.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_is_torch_rms_norm_and_keeps_the_output_not_the_input(dtype):
    """QKNorm against torch's own `F.rms_norm`: output, input gradient and weight gradient; and
    what its backward keeps: the input is a view of the fused q, k, v projection, which must not
    stay alive through it (the memory promise of issue 33 item 9)."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 3, 4, 16).to(dtype)  # (B, N, q/k/v, heads, head dim)
    norm = QKNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16) * 0.5 + 1)
    weight = norm.weight.detach().clone().requires_grad_()
    ours_in, ref_in = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(ours_in[:, :, 0])
    assert saved and all(
        t.untyped_storage().data_ptr() != ours_in.untyped_storage().data_ptr() for t in saved
    )
    ref = F.rms_norm(ref_in[:, :, 0], (16,), weight, eps=1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    upstream = torch.randn(out.shape)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, **tol)
    torch.testing.assert_close(norm.weight.grad, weight.grad, **tol)


def saved_activation_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `run()`, weights not
    counted: the activation memory of a training step."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def test_training_step_keeps_fewer_activations_than_diffusers():
    """Issue 33 item 9 (memory <= 1x): at the same weights and inputs, the forward of ours leaves
    fewer bytes for the backward than diffusers' SD3Transformer2DModel (3.5 Medium structure:
    QK RMSNorm and attn2). Counted by autograd's own saved-tensor hooks, not timed."""
    ours, theirs = tiny_pair("sd35_medium")
    torch.manual_seed(1)
    x, t = torch.randn(1, 4, 16, 16), torch.rand(1) * 1000  # 64 image tokens
    context, pooled = torch.randn(1, 16, TINY["context_dim"]), torch.randn(1, TINY["pooled_dim"])
    mine = saved_activation_bytes(
        ours, lambda: ours(x, t, {"crossattn": context, "vector": pooled})
    )
    reference = saved_activation_bytes(
        theirs,
        lambda: theirs(
            hidden_states=x,
            encoder_hidden_states=context,
            pooled_projections=pooled,
            timestep=t,
            return_dict=False,
        ),
    )
    assert mine < 0.95 * reference, (mine, reference)


def test_gradient_checkpointing_keeps_output_and_gradients():
    ours, _ = tiny_pair("sd35_medium")
    ours.train()
    x = torch.randn(2, 4, 8, 8)
    cond = {"crossattn": torch.randn(2, 3, TINY["context_dim"]), "vector": torch.randn(2, 16)}
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
    """adaLN-Zero (DiT sec. 3.2): the output layer starts at zero, so does the prediction."""
    model = MMDiT(**TINY)
    out = model(
        torch.randn(1, 4, 8, 8),
        torch.tensor([500.0]),
        {"crossattn": torch.randn(1, 3, 24), "vector": torch.randn(1, 16)},
    )
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(model.joint_blocks[0].x_block.attn.qkv.weight) > 0


def test_bad_input_is_one_clear_error():
    model = MMDiT(**TINY)
    cond = {"crossattn": torch.randn(1, 3, 24), "vector": torch.randn(1, 16)}
    with pytest.raises(ValueError, match="position table"):
        model(torch.randn(1, 4, 18, 8), torch.tensor([1.0]), cond)  # 9 patches > 8
    with pytest.raises(ValueError, match="'vector'"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1.0]), {"crossattn": cond["crossattn"]})
    with pytest.raises(ValueError, match="multiples of the patch size"):
        model(torch.randn(1, 4, 7, 8), torch.tensor([1.0]), cond)
