"""SD3's conditioning (ldm.conditioning_sd3, ldm.text_encoder_t5) against code we did not write:
diffusers' StableDiffusion3Pipeline.encode_prompt (its CLIP penultimate layers, pooled outputs,
the pad of CLIP-L ++ bigG to T5's width, the token concat, the zeros without T5 and the ""
negative) run on text encoders that diffusers' own single-file rules load from our state dict;
the per-encoder dropout against the paper's rate and independence (Esser et al. 2024)."""

import math
from pathlib import Path

import pytest
import torch
from sd3_helpers import (  # noqa: E402
    CONTEXT_DIM,
    T5_TOKENS,
    t5_model_folder,
    t5_tokenizer_folder,
    tiny_conditioner_params,
)

from ldm.conditioning_sd3 import CLIP_TOKENS, SD3Conditioner

diffusers = pytest.importorskip("diffusers")
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402
from diffusers.loaders.single_file_utils import (  # noqa: E402
    convert_ldm_clip_checkpoint,
    convert_sd3_t5_checkpoint_to_diffusers,
)
from transformers import (  # noqa: E402
    AutoTokenizer,
    CLIPTextModelWithProjection,
    T5EncoderModel,
)

PROMPTS = ["a photo of a cat", "red dog, blue sky 2"]
# Esser et al. 2024 (sec. 5.3.3): each text encoder dropped independently 46.3 % of the time.
PAPER_DROP_RATE = 0.463
STABILITY_PREFIX = "text_encoders."  # the single files' names, read by diffusers' rules


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    return t5_model_folder(tmp_path_factory.mktemp("t5"))


def randomised(conditioner: SD3Conditioner) -> SD3Conditioner:
    """Non-trivial LayerNorm weights and biases too (a fresh CLIP has ones / zeros there)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in conditioner.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return conditioner


def diffusers_pipeline(conditioner: SD3Conditioner, t5_folder: Path | None, clip_folder: Path):
    """StableDiffusion3Pipeline whose text encoders are loaded by diffusers' single-file rules
    from our state dict in Stability's layout (strict: every key used, none missing)."""
    state = {STABILITY_PREFIX + k: v for k, v in conditioner.state_dict().items()}
    encoders = []
    for name, embedder in (("clip_l", conditioner.clip_l), ("clip_g", conditioner.clip_g)):
        config = embedder.transformer.config
        model = CLIPTextModelWithProjection(config)
        weights = convert_ldm_clip_checkpoint(state, f"{STABILITY_PREFIX}{name}.transformer.")
        if name == "clip_l":  # what diffusers' loader adds for SD3's CLIP-L (no projection)
            weights["text_projection.weight"] = torch.eye(config.hidden_size)
        model.load_state_dict(weights, strict=True)
        encoders.append(model.eval())
    t5 = tokenizer_3 = None
    if conditioner.t5xxl is not None:
        t5 = T5EncoderModel.from_pretrained(t5_folder).eval()
        weights = convert_sd3_t5_checkpoint_to_diffusers(state)
        t5.load_state_dict(weights, strict=False)  # the tied embed_tokens is shared.weight
        assert torch.equal(
            t5.encoder.embed_tokens.weight,
            state[f"{STABILITY_PREFIX}t5xxl.transformer.shared.weight"],
        )
        tokenizer_3 = AutoTokenizer.from_pretrained(t5_folder)
    # SD3's tokenizer_2 pads with "!" (id 0), its tokenizer with <|endoftext|>.
    tokenizer_2 = AutoTokenizer.from_pretrained(clip_folder, pad_token="!")
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=CONTEXT_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=40,
        out_channels=4,
        pos_embed_max_size=8,
    )  # fmt: skip - only its joint_attention_dim is read (the zeros without T5)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=None,
        vae=None,
        text_encoder=encoders[0],
        tokenizer=conditioner.clip_l.tokenizer,
        text_encoder_2=encoders[1],
        tokenizer_2=tokenizer_2,
        text_encoder_3=t5,
        tokenizer_3=tokenizer_3,
    )


@pytest.mark.parametrize("with_t5", [True, False])
def test_matches_diffusers_encode_prompt(t5_folder, tmp_path, with_t5):
    params = tiny_conditioner_params(None)
    if with_t5:
        params["t5xxl"] = {"version": str(t5_folder)}
    conditioner = randomised(SD3Conditioner(**params))
    # A CLIP tokenizer folder for diffusers' tokenizer_2 (same vocabulary, "!" padding).
    conditioner.clip_l.tokenizer.save_pretrained(tmp_path / "clip_tok")
    pipe = diffusers_pipeline(conditioner, t5_folder if with_t5 else None, tmp_path / "clip_tok")
    with torch.no_grad():
        embeds, neg_embeds, pooled, neg_pooled = pipe.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=True, max_sequence_length=T5_TOKENS
        )
    ours = conditioner.condition({"caption": PROMPTS})
    uncond = conditioner.unconditional({"caption": PROMPTS})
    assert ours["crossattn"].shape == (2, CLIP_TOKENS + T5_TOKENS, CONTEXT_DIM)
    torch.testing.assert_close(ours["crossattn"], embeds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["vector"], pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(uncond["crossattn"], neg_embeds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(uncond["vector"], neg_pooled, rtol=1e-5, atol=1e-5)
    # The pad and the T5 tokens are not trivially equal (both sides could be zeros).
    assert ours["crossattn"][:, :CLIP_TOKENS].abs().sum() > 0
    assert (ours["crossattn"][:, CLIP_TOKENS:].abs().sum() > 0) == with_t5


def dropped_parts(out: dict, clip_l_width: int, clip_width: int) -> dict[str, torch.Tensor]:
    """Per sample, whether each encoder's part of the conditioning is all zeros."""
    x, v = out["crossattn"], out["vector"]
    clip = x[:, :CLIP_TOKENS]
    return {
        "clip_l": (clip[..., :clip_l_width] == 0).flatten(1).all(1)
        & (v[:, :clip_l_width] == 0).all(1),
        "clip_g": (clip[..., clip_l_width:clip_width] == 0).flatten(1).all(1)
        & (v[:, clip_l_width:] == 0).all(1),
        "t5xxl": (x[:, CLIP_TOKENS:] == 0).flatten(1).all(1),
    }


def test_each_encoder_dropped_independently_at_the_papers_rate(tmp_path):
    conditioner = SD3Conditioner(**tiny_conditioner_params(t5_tokenizer_folder(tmp_path)))
    n = 300
    captions = [f"a photo of {i}" for i in range(n)]
    full = conditioner.condition({"caption": captions})
    out = conditioner.condition(
        {"caption": captions}, generator=torch.Generator().manual_seed(0), drop=True
    )
    parts = dropped_parts(out, 16, 40)
    sigma = math.sqrt(PAPER_DROP_RATE * (1 - PAPER_DROP_RATE) / n)
    for name, dropped in parts.items():
        assert abs(dropped.float().mean().item() - PAPER_DROP_RATE) < 4 * sigma, name
    # Independence: P(a dropped, b kept) = p (1 - p) for every pair; all three dropped p^3.
    names = list(parts)
    for a in names:
        for b in names:
            if a != b:
                share = (parts[a] & ~parts[b]).float().mean().item()
                assert abs(share - PAPER_DROP_RATE * (1 - PAPER_DROP_RATE)) < 0.08, (a, b)
    all_three = (parts["clip_l"] & parts["clip_g"] & parts["t5xxl"]).float().mean().item()
    assert abs(all_three - PAPER_DROP_RATE**3) < 0.06
    # A kept encoder's part is untouched by the others' dropping.
    keep = ~parts["clip_l"]
    torch.testing.assert_close(out["vector"][keep, :16], full["vector"][keep, :16])
    keep = ~parts["t5xxl"]
    torch.testing.assert_close(
        out["crossattn"][keep, CLIP_TOKENS:], full["crossattn"][keep, CLIP_TOKENS:]
    )
    # Sampling (drop=False) never drops.
    assert not any(p.any() for p in dropped_parts(full, 16, 40).values())


def test_missing_t5_folders_are_one_line_naming_the_key(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(
        ValueError, match=r"^conditioner_config\.params\.t5xxl\.tokenizer: .*nowhere"
    ):
        SD3Conditioner(**tiny_conditioner_params(missing))
    with pytest.raises(ValueError, match=r"^conditioner_config\.params\.t5xxl\.version: .*nowhere"):
        SD3Conditioner(**{**tiny_conditioner_params(None), "t5xxl": {"version": str(missing)}})
    with pytest.raises(ValueError, match=r"^conditioner_config\.params\.t5xxl\.tokenizer: not set"):
        SD3Conditioner(**{**tiny_conditioner_params(None), "t5xxl": {}})


def test_state_dict_is_stabilitys_text_encoder_layout(tmp_path):
    """Names under text_encoders.: transformers' CLIPTextModel (clip_l, no projection),
    CLIPTextModelWithProjection (clip_g) and T5EncoderModel without the tied duplicate, as
    diffusers' detectors for SD3 files look them up; a state dict reloads strictly."""
    conditioner = SD3Conditioner(**tiny_conditioner_params(t5_tokenizer_folder(tmp_path)))
    keys = {STABILITY_PREFIX + k for k in conditioner.state_dict()}
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, is_t5_in_single_file

    assert CHECKPOINT_KEY_NAMES["clip_sd3"] in keys
    assert CHECKPOINT_KEY_NAMES["open_clip_sd3"] in keys
    assert is_t5_in_single_file(dict.fromkeys(keys))
    assert "text_encoders.clip_g.transformer.text_projection.weight" in keys
    assert not any(k.startswith("text_encoders.clip_l.transformer.text_projection") for k in keys)
    assert "text_encoders.t5xxl.transformer.encoder.embed_tokens.weight" not in keys
    state = randomised(conditioner).state_dict()
    fresh = SD3Conditioner(**tiny_conditioner_params(t5_tokenizer_folder(tmp_path)))
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(
        fresh.t5xxl.transformer.encoder.embed_tokens.weight,
        state["t5xxl.transformer.shared.weight"],
    )


def test_a_file_without_an_encoders_weights(t5_folder, tmp_path):
    """sd3.5_large.safetensors has no text_encoders.*: an encoder from its own folder keeps its
    weights; one built for the file's weights (T5 without `version`) is one line."""
    state = SD3Conditioner(**tiny_conditioner_params(None)).state_dict()  # no T5 in the file
    from_folder = SD3Conditioner(
        **{**tiny_conditioner_params(None), "t5xxl": {"version": str(t5_folder)}}
    )
    before = {k: v.clone() for k, v in from_folder.t5xxl.state_dict().items()}
    assert not from_folder.load_state_dict(state, strict=True).missing_keys
    assert all(torch.equal(v, from_folder.t5xxl.state_dict()[k]) for k, v in before.items())
    built = SD3Conditioner(**tiny_conditioner_params(t5_tokenizer_folder(tmp_path)))
    with pytest.raises(ValueError, match=r"^the weights file has no t5xxl weights .*t5xxl: null"):
        built.load_state_dict(state, strict=True)
