"""Flux.1's conditioning (ldm.conditioning_flux) against code we did not write: diffusers'
FluxPipeline.encode_prompt (T5's last hidden state, CLIP-L's pooled output) on the same weights,
transformers' T5EncoderModel / CLIPTextModel and a hand-taken <eot> feature; dev's guidance scale
reaching the backbone's guidance input; the caption dropout; the family of a Flux file."""

from pathlib import Path

import pytest
import torch
from sd3_helpers import CLIP_L, T5_CONFIG, t5_model_folder, t5_tokenizer_folder
from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

from ldm.checkpoint import WrongFileError, check_family
from ldm.conditioning_flux import FluxConditioner
from ldm.flux import Flux
from ldm.layout import family

PROMPTS = ["a photo of a cat", "red dog, blue sky 2"]
T5_TOKENS = 12
CLIP_WIDTH, T5_WIDTH = CLIP_L["config"]["hidden_size"], T5_CONFIG["d_model"]


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    return t5_model_folder(tmp_path_factory.mktemp("t5"))


def conditioner(t5_folder, **extra) -> FluxConditioner:
    """A tiny FluxConditioner, its CLIP LayerNorms randomised too (fresh ones are 1 / 0)."""
    cond = FluxConditioner(
        clip_l=CLIP_L, t5xxl={"version": str(t5_folder)}, t5_tokens=T5_TOKENS, **extra
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in cond.clip_l.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return cond


def tiny_flux(guidance_embed=True, **kw) -> Flux:
    torch.manual_seed(0)
    model = Flux(
        depth=1, depth_single_blocks=1, hidden_size=32, num_heads=2, axes_dim=(4, 6, 6),
        context_dim=T5_WIDTH, pooled_dim=CLIP_WIDTH, guidance_embed=guidance_embed, **kw,
    )  # fmt: skip
    with torch.no_grad():  # past adaLN-Zero, so every input shows in the output
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def test_matches_diffusers_flux_encode_prompt(t5_folder):
    from diffusers import FluxPipeline

    cond = conditioner(t5_folder)
    ours = cond.clip_l.transformer.text_model  # ldm.text_encoder wraps a CLIPTextModel
    clip = CLIPTextModel(ours.config).eval()
    clip.load_state_dict(ours.state_dict(), strict=True)
    pipe = FluxPipeline(
        scheduler=None,
        vae=None,
        text_encoder=clip,
        tokenizer=cond.clip_l.tokenizer,
        text_encoder_2=T5EncoderModel.from_pretrained(t5_folder).eval(),
        tokenizer_2=AutoTokenizer.from_pretrained(t5_folder),
        transformer=None,
    )
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(
            PROMPTS, None, device="cpu", max_sequence_length=T5_TOKENS
        )
    ours = cond.condition({"caption": PROMPTS})
    assert ours["crossattn"].shape == (2, T5_TOKENS, T5_WIDTH)
    assert ours["vector"].shape == (2, CLIP_WIDTH)
    torch.testing.assert_close(ours["crossattn"], embeds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["vector"], pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["guidance"], torch.full((2,), 3.5))  # dev's default


def test_pooled_is_clips_final_layernorm_at_the_eot_token(t5_folder):
    """BFL HFEmbedder(output_key="pooler_output"): the final LayerNorm's feature at <eot>."""
    cond = conditioner(t5_folder)
    ids = cond.clip_l.tokenizer(
        PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    eot = cond.clip_l.tokenizer.eos_token_id
    first_eot = (ids == eot).int().argmax(dim=1)  # CLIP-L pads with <eot>: its first one
    with torch.no_grad():
        hidden = cond.clip_l.transformer(input_ids=ids).last_hidden_state
    expected = hidden[torch.arange(len(PROMPTS)), first_eot]
    assert (first_eot < 76).all()  # the padded positions differ: the choice matters
    torch.testing.assert_close(cond.condition({"caption": PROMPTS})["vector"], expected)


def test_guidance_reaches_the_backbone_and_schnell_has_none(t5_folder):
    dev = conditioner(t5_folder, guidance=3.5)
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([300.0, 700.0])
    model = tiny_flux()  # no default guidance: cond["guidance"] must be given
    out = model(x, t, dev.condition({"caption": PROMPTS}))
    dev.guidance = 1.0
    assert not torch.allclose(out, model(x, t, dev.condition({"caption": PROMPTS})))
    # BFL sampling.py: guidance_vec = full((B,), guidance) into guidance_in(embed(g * 1000))
    torch.testing.assert_close(out, model(x, t, {**dev.encode(PROMPTS), "guidance": 3.5}))
    schnell = conditioner(t5_folder, guidance=None)
    assert "guidance" not in schnell.condition({"caption": PROMPTS})
    tiny_flux(guidance_embed=False)(x, t, schnell.condition({"caption": PROMPTS}))


def test_dropout_trains_on_the_empty_caption(t5_folder):
    cond = conditioner(t5_folder, drop_rate=0.25)
    empty = cond.unconditional({"caption": PROMPTS})
    captions = {"caption": ["a photo of a cat"] * 400}
    out = cond.condition(captions, torch.Generator().manual_seed(0), drop=True)
    dropped = (out["vector"] - empty["vector"][:1]).abs().sum(-1) == 0
    same_t5 = (out["crossattn"] - empty["crossattn"][:1]).abs().flatten(1).sum(-1) == 0
    assert torch.equal(dropped, same_t5)  # both encoders read ""
    assert 65 < dropped.sum() < 135  # Binomial(400, 0.25): 100 +- 4 sigma (8.7)
    kept = cond.condition(captions)  # no drop outside training
    assert not ((kept["vector"] - empty["vector"][:1]).abs().sum(-1) == 0).any()


def test_bad_values_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"conditioner_config\.params\.t5xxl: Flux needs T5"):
        FluxConditioner(clip_l=CLIP_L)
    with pytest.raises(ValueError, match=r"conditioner_config\.params\.drop_rate"):
        FluxConditioner(clip_l=CLIP_L, t5xxl={"tokenizer": "x"}, drop_rate=2)
    tok = t5_tokenizer_folder(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"conditioner_config\.params\.t5xxl\.version"):
        FluxConditioner(clip_l=CLIP_L, t5xxl={"version": str(tmp_path / "nope"), "tokenizer": tok})


def test_a_bfl_file_keeps_encoders_read_from_folders(t5_folder):
    """BFL's flux1-*.safetensors hold the transformer only: T5 read from its folder keeps its
    weights; the random-init CLIP-L, built for a file's weights, is one line naming the key."""
    cond = conditioner(t5_folder)
    clip_only = {k: v for k, v in cond.state_dict().items() if k.startswith("clip_l.")}
    result = cond.load_state_dict(clip_only, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    with pytest.raises(ValueError, match=r"no clip_l weights .*clip_l\.version"):
        cond.load_state_dict({}, strict=False)


def test_flux_family_against_sd3_and_sd1():
    model = tiny_flux()
    bare = list(model.state_dict())  # a BFL flux1-*.safetensors
    comfy = ["model.diffusion_model." + k for k in bare] + ["text_encoders.clip_l.transformer.x"]
    assert family.model_family(bare) == family.FLUX
    assert family.model_family(comfy) == family.FLUX  # not SD3, despite text_encoders.*
    assert family.model_family(["model.diffusion_model.joint_blocks.0.x"]) == family.SD3
    with pytest.raises(WrongFileError, match=r"^flux\.safetensors is a Flux\.1 checkpoint, expected an SD 3"):  # fmt: skip
        check_family("flux.safetensors", family.FLUX, family.SD3)


def test_a_flux_file_into_an_sd3_model_and_the_reverse_are_one_line(tmp_path):
    from ldm.checkpoint import load_weights, save_safetensors
    from ldm.mmdit import MMDiT

    flux = tiny_flux()
    sd3 = MMDiT(depth=1, hidden_size=32, num_heads=2, in_channels=16, context_dim=48,
                pooled_dim=40, pos_embed_max_size=16)  # fmt: skip
    save_safetensors(flux.state_dict(), tmp_path / "flux1.safetensors")  # BFL's bare names
    save_safetensors(sd3.state_dict(), tmp_path / "sd3.safetensors")
    with pytest.raises(WrongFileError, match=r"flux1\.safetensors is a Flux\.1 checkpoint, expected an SD 3"):  # fmt: skip
        load_weights(sd3, tmp_path / "flux1.safetensors")
    with pytest.raises(WrongFileError, match=r"sd3\.safetensors is an SD 3 checkpoint, expected a Flux\.1"):  # fmt: skip
        load_weights(flux, tmp_path / "sd3.safetensors")
