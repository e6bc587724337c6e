"""DiT / TextDiT: the released layout, parity with diffusers, positions, patches, checkpointing."""

import json
from pathlib import Path

import pytest
import torch

from ldm.dit import DiT, DiT_models, DiT_S_2, DiT_XL_2, modulate, sincos_pos_embed_2d
from ldm.dit_text import TextDiT
from ldm.layout.dit import dit_to_diffusers

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"  # key -> shape lists of the released DiT files
TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4)


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random (std 0.1), the adaLN-Zero layers included: at DiT's zero init each
    block is the identity and the output is zero, which would hide almost any bug."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name != "pos_embed":
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize(
    ("preset", "reference"), [(DiT_XL_2, "dit_xl2_256_keys.json"), (DiT_S_2, "dit_s2_keys.json")]
)
def test_state_dict_is_the_released_layout(preset, reference):
    """Keys and shapes of DiT-XL/2 (256 px, 1000 classes, learn_sigma) are exactly those of
    DiT-XL-2-256x256.pt, so it loads strictly; built on the meta device (no 2.7 GB)."""
    with torch.device("meta"):
        model = preset(input_size=32, num_classes=1000)
    expected = json.loads((REFERENCE / reference).read_text())
    ours = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert ours == expected["keys"]
    total = sum(p.numel() for p in model.parameters())
    assert total == expected["parameter_counts"]["total (incl. pos_embed)"]
    assert not model.pos_embed.requires_grad  # fixed table, a parameter as in the original


def test_presets_follow_the_paper_table():
    """DiT table 1: depth / width / heads per size, patch size in the name."""
    sizes = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
    for name, make in DiT_models.items():
        with torch.device("meta"):
            model = make(input_size=32)
        size, patch = name.removeprefix("DiT-").split("/")
        depth, width, heads = sizes[size]
        assert (len(model.blocks), model.pos_embed.shape[-1], model.patch_size) == (
            depth,
            width,
            int(patch),
        )
        assert model.blocks[0].attn.num_heads == heads
        assert model.pos_embed.shape[1] == (32 // int(patch)) ** 2


def test_pos_embed_is_the_mae_table():
    """Channel 0 of the table is sin(column), channel D/2 is sin(row) (MAE's meshgrid order, which
    DiT inherits): a transposed table would swap them."""
    dim, grid = 16, 4
    table = sincos_pos_embed_2d(dim, grid, grid)  # (16, 16)
    rows, cols = torch.arange(grid).repeat_interleave(grid), torch.arange(grid).repeat(grid)
    torch.testing.assert_close(table[:, 0], torch.sin(cols.float()))
    torch.testing.assert_close(table[:, dim // 4], torch.cos(cols.float()))
    torch.testing.assert_close(table[:, dim // 2], torch.sin(rows.float()))
    omega = 1 / 10000 ** (1 / (dim / 4))
    torch.testing.assert_close(table[:, 1], torch.sin(cols * omega).float())
    # The model's parameter holds the table at its native grid.
    model = DiT(**TINY, num_classes=3)
    torch.testing.assert_close(model.pos_embed[0], sincos_pos_embed_2d(64, 4, 4))


def test_modulate_scales_then_shifts():
    x, shift, scale = torch.ones(1, 2, 3), torch.full((1, 3), 2.0), torch.full((1, 3), 0.5)
    assert torch.equal(modulate(x, shift, scale), torch.full((1, 2, 3), 3.5))  # 1 * 1.5 + 2


def test_adaln_zero_starts_as_zero_output_and_identity_blocks():
    """At initialisation every block is the identity and the output is zero (DiT sec. 3.2)."""
    model = DiT(**TINY, num_classes=3).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([0, 3])
    tokens = model.patchify(x)
    c = model.t_embedder(t) + model.y_embedder(y)
    assert torch.equal(model.blocks[0](tokens, c), tokens)
    assert torch.equal(model(x, t, {"y": y}), torch.zeros(2, 8, 8, 8))


def test_tokens_are_row_major_through_the_blocks():
    """Speed, not values: the patch tokens leave patchify contiguous (B, N, D), so every block's
    residual adds keep that layout (a transposed view there made each LayerNorm copy it)."""
    model = DiT(**TINY, num_classes=3)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([0, 3])
    tokens = model.patchify(x)
    c = model.t_embedder(t) + model.y_embedder(y)
    assert tokens.is_contiguous() and model.blocks[0](tokens, c).is_contiguous()


def test_unpatchify_inverts_the_patch_layout():
    """A final layer that copies each patch's pixels back gives x again: unpatchify puts token
    (row, col) and its (p_row, p_col, channel) values where patchify took them."""
    model = DiT(**TINY, num_classes=3, learn_sigma=False)
    p, x = 2, torch.randn(2, 4, 8, 6)
    patches = x.unfold(2, p, p).unfold(3, p, p)  # (B, C, H/p, W/p, p, p)
    tokens = patches.permute(0, 2, 3, 4, 5, 1).reshape(2, 12, p * p * 4)  # (B, N, p*p*C)
    assert torch.equal(model.unpatchify(tokens, 8, 6), x)


def diffusers_dit(num_classes: int):
    """diffusers' DiTTransformer2DModel at TINY's size. Its timestep sinusoids divide the
    exponent by half - 1 (`downscale_freq_shift=1`), the DiT code by half: diffusers' own
    Timesteps with the DiT formula is swapped in, so every other part is compared exactly."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.embeddings import Timesteps

    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=num_classes,
        norm_eps=1e-6,  # DiT's LayerNorms
    )
    for block in model.transformer_blocks:
        block.norm1.emb.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        # In train mode diffusers drops class labels itself (p = 0.1, drawn anew in every
        # block); here that dropout is the conditioner's (ClassLabels.ucg_rate), not the model's.
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    return model.eval()


def test_parity_with_diffusers_dit_transformer():
    """Same random weights (adaLN-Zero layers non-zero), converted by diffusers' rules
    (ldm.checkpoint.dit_to_diffusers, after its scripts/convert_dit_to_diffusers.py): every key
    of DiTTransformer2DModel filled, the same eps and variance outputs, real and null classes."""
    ours = randomized(DiT(**TINY, num_classes=10)).eval()
    theirs = diffusers_dit(num_classes=10)
    missing, unexpected = theirs.load_state_dict(dit_to_diffusers(ours.state_dict()), strict=False)
    assert not unexpected and not missing
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=generator)
    t, y = torch.tensor([0, 500, 999]), torch.tensor([2, 10, 7])  # 10 = the null class
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        got = ours(x, t, {"y": y})
    assert got.shape == (3, 8, 8, 8) and got.abs().mean() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_training_gradients_match_diffusers():
    """The backward pass too (what the training benchmark times): the same loss gives every
    weight the gradient of its converted diffusers twin; the timestep and class embedders, which
    diffusers copies into every block, get the sum of the copies' gradients."""
    ours = randomized(DiT(**TINY, num_classes=10)).train()
    theirs = diffusers_dit(num_classes=10).train()
    theirs.load_state_dict(dit_to_diffusers(ours.state_dict()))
    generator = torch.Generator().manual_seed(2)
    x, target = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 8, 8, 8)
    t, y = torch.tensor([3, 800]), torch.tensor([4, 10])
    (ours(x, t, {"y": y}) - target).square().mean().backward()
    (theirs(x, timestep=t, class_labels=y).sample - target).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters() if p.requires_grad}
    expected = {k: p.grad for k, p in theirs.named_parameters()}
    embedders = ("t_embedder.", "y_embedder.")
    got = dit_to_diffusers({**grads, "pos_embed": ours.pos_embed})
    for key, grad in got.items():
        if ".norm1.emb." not in key:
            torch.testing.assert_close(grad, expected[key], rtol=1e-4, atol=1e-6, msg=key)
    for name in (k for k in grads if k.startswith(embedders)):
        twin = dit_to_diffusers({**grads, "pos_embed": ours.pos_embed, name: grads[name]})
        copies = [k for k, v in twin.items() if ".norm1.emb." in k and v is grads[name]]
        total = sum(expected[k] for k in copies)
        assert len(copies) == TINY["depth"] and grads[name].abs().sum() > 0
        torch.testing.assert_close(grads[name], total, rtol=1e-4, atol=1e-6, msg=name)


def test_diffusers_timestep_formula_differs_from_the_dit_code():
    """Why the parity test swaps diffusers' time_proj: its DiT sinusoids (downscale_freq_shift=1)
    are not those of the DiT code the released weights were trained with; shift 0 is."""
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import Timesteps

    from ldm.unet import timestep_embedding

    t = torch.tensor([0.0, 17.0, 999.0])
    ours = timestep_embedding(t, 256)
    torch.testing.assert_close(Timesteps(256, True, downscale_freq_shift=0)(t), ours)
    assert not torch.allclose(Timesteps(256, True, downscale_freq_shift=1)(t), ours, atol=1e-2)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = randomized(DiT(**TINY, num_classes=3)).train()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1])

    def grads(enabled: bool) -> list[torch.Tensor]:
        model.zero_grad()
        model.set_gradient_checkpointing(enabled)
        model(x, t, {"y": y}).square().mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    for plain, checkpointed in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(plain, checkpointed)


def test_other_sizes_and_the_null_class():
    """Non-native latent sides run (positions recomputed); the null class changes the output."""
    model = randomized(DiT(**TINY, num_classes=3)).eval()
    x, t = torch.randn(1, 4, 12, 8), torch.tensor([10])
    with torch.no_grad():
        real, null = model(x, t, {"y": torch.tensor([1])}), model(x, t, {"y": torch.tensor([3])})
    assert real.shape == (1, 8, 12, 8) and not torch.allclose(real, null)
    with pytest.raises(ValueError, match="multiples of the patch size"):
        model(torch.randn(1, 4, 7, 8), t, {"y": torch.tensor([1])})
    with pytest.raises(ValueError, match="'y'"):
        model(x, t, {"crossattn": torch.randn(1, 2, 3)})


def test_text_dit_attends_to_the_caption():
    """TextDiT: shape, the caption matters (cross-attention), adaLN-single has one shared MLP,
    and at init the cross-attention and output start at zero."""
    kwargs = dict(TINY, context_dim=24)
    fresh = TextDiT(**kwargs)
    assert all(b.cross_attn.proj.weight.abs().sum() == 0 for b in fresh.blocks)
    assert not any("adaLN_modulation" in name for name, _ in fresh.named_parameters())
    model = randomized(TextDiT(**kwargs)).eval()
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([5, 600])
    context = torch.randn(2, 7, 24)
    with torch.no_grad():
        out = model(x, t, {"crossattn": context})
        other = model(x, t, {"crossattn": context.flip(0)})
        shuffled = model(x.flip(0), t.flip(0), {"crossattn": context.flip(0)}).flip(0)
    assert out.shape == (2, 4, 8, 8)
    assert not torch.allclose(out, other, atol=1e-4)  # another caption, another prediction
    torch.testing.assert_close(out, shuffled)  # samples do not mix within a batch
