"""Text encoders: original checkpoint names, parity with transformers / torch MHA, CLIP tokenizer ids."""

import gzip
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import pytest
import regex
import torch
from transformers import CLIPTextConfig, CLIPTextModel

from ldm.text_encoder import (
    CLIP_VIT_L14_TEXT_CONFIG,
    FrozenCLIPEmbedder,
    FrozenOpenCLIPEmbedder,
    bpe_vocab_path,
    bytes_to_unicode,
    clip_tokenizer,
    open_clip_tokenize,
)
from ldm.util import instantiate_from_config

REFERENCE = Path(__file__).resolve().parents[1] / "reference"
PREFIX = "cond_stage_model."
SOT, EOT = 49406, 49407
TINY_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}
TINY_OPENCLIP = {"width": 32, "layers": 3, "heads": 4, "embed_dim": 16}
PROMPTS = [
    "a photo of a cat",
    "A Photograph of an ASTRONAUT riding a horse, 4k, trending on artstation!!",
    "  don't   stop... it's 1990's café-style (oil on canvas) #art @home $5 ",
    "naïve façade ünïcödé — 東京 🐱",
    "",
]


def reference_keys(keys_file: str) -> dict[str, list[int]]:
    keys = json.loads((REFERENCE / keys_file).read_text())["keys"]
    return {k[len(PREFIX) :]: shape for k, shape in keys.items() if k.startswith(PREFIX)}


@pytest.fixture(scope="module")
def tokenizer():
    return clip_tokenizer()


# ------------------------------------------------------------------------ checkpoint layout


def test_openclip_h14_state_dict_matches_original_checkpoint():
    with torch.device("meta"):
        encoder = instantiate_from_config(
            {
                "target": "ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder",
                "params": {"freeze": True, "layer": "penultimate"},  # the v2 config, unchanged
            }
        )
    ours = {k: list(v.shape) for k, v in encoder.state_dict().items()}
    assert ours == reference_keys("sd_v2_base_keys.json")
    assert ours["model.text_projection"] == [1024, 1024]
    assert sum(p.numel() for p in encoder.parameters()) == 354_032_641


def test_clip_vit_l14_state_dict_matches_original_checkpoint_up_to_library_naming():
    with torch.device("meta"):
        encoder = instantiate_from_config(
            {"target": "ldm.modules.encoders.modules.FrozenCLIPEmbedder"}  # the v1 config
        )
    ours = {k: list(v.shape) for k, v in encoder.state_dict().items()}
    reference = reference_keys("sd_v1_keys.json")
    assert len(reference) == 197 and len(ours) == 196
    # The only difference: `position_ids` is a non-persistent buffer (absent since 4.31), which
    # ldm.checkpoint drops on load. The `text_model.` level, which transformers >= 5.6 lacks,
    # is kept by `with_text_model_level`: our own names are the original ones.
    expected = {k: s for k, s in reference.items() if not k.endswith("embeddings.position_ids")}
    assert ours == expected
    buffers = dict(encoder.named_buffers())
    assert list(buffers) == ["transformer.text_model.embeddings.position_ids"]
    assert "transformer.text_model.embeddings.position_ids" not in ours
    assert sum(p.numel() for p in encoder.parameters()) == 123_060_480


# ----------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=1)
def independent_bpe_tables():
    """CLIP SimpleTokenizer's tables, rebuilt here from the gz file."""
    with gzip.open(bpe_vocab_path(), "rt", encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1 : 49152 - 256 - 2 + 1]]
    byte_chars = list(bytes_to_unicode().values())
    vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(vocab)}, {m: rank for rank, m in enumerate(merges)}


def independent_bpe(word: tuple[str, ...], ranks: dict) -> list[str]:
    """Greedy lowest-rank pair merging (Sennrich et al. 2016) as in CLIP's SimpleTokenizer.bpe."""
    word = list(word[:-1]) + [word[-1] + "</w>"]
    while len(word) > 1:
        pairs = [(ranks.get(p, float("inf")), i, p) for i, p in enumerate(zip(word, word[1:]))]
        rank, _, best = min(pairs)
        if rank == float("inf"):
            break
        merged, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                merged.append(word[i] + word[i + 1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return word


def independent_encode(text: str) -> list[int]:
    vocab, ranks = independent_bpe_tables()
    byte_encoder = bytes_to_unicode()
    pattern = regex.compile(
        r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
        regex.IGNORECASE,
    )
    ids = [SOT]
    for piece in pattern.findall(" ".join(text.split()).lower()):
        chars = tuple(byte_encoder[b] for b in piece.encode("utf-8"))
        ids += [vocab[token] for token in independent_bpe(chars, ranks)]
    return ids + [EOT]


def test_bytes_to_unicode_is_a_printable_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord("a")] == "a" and table[ord(" ")] == "Ġ"


def test_tokenizer_ids_equal_openai_clip(tokenizer):
    # Ids as released by OpenAI CLIP / printed by every SD v1 tokenizer.
    assert tokenizer("a photo of a cat")["input_ids"] == [SOT, 320, 1125, 539, 320, 2368, EOT]
    assert tokenizer("a photograph of an astronaut riding a horse")["input_ids"] == [
        *[SOT, 320, 8853, 539, 550, 18376, 6765, 320, 4558, EOT]
    ]
    assert len(tokenizer) == 49408


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenizer_agrees_with_an_independent_bpe(tokenizer, prompt):
    assert tokenizer(prompt)["input_ids"] == independent_encode(prompt)


def test_v1_tokens_pad_with_eot_and_truncate_keeping_eot():
    encoder = FrozenCLIPEmbedder(config=TINY_CLIP)
    tokens = encoder.tokenize(["a photo of a cat", "cat " * 100])
    assert tokens.shape == (2, 77)
    assert tokens[0].tolist() == [SOT, 320, 1125, 539, 320, 2368] + [EOT] * 71
    assert tokens[1].tolist() == [SOT] + [2368] * 75 + [EOT]


def test_v2_tokens_pad_with_zeros_like_open_clip(tokenizer):
    tokens = open_clip_tokenize(tokenizer, ["a photo of a cat", "cat " * 100, "fish &amp; chips"])
    assert tokens.shape == (3, 77) and tokens.dtype == torch.long
    assert tokens[0].tolist() == [SOT, 320, 1125, 539, 320, 2368, EOT] + [0] * 70
    assert tokens[1].tolist() == [SOT] + [2368] * 75 + [EOT]
    assert tokens[2, :6].tolist() == independent_encode("fish & chips") + [0]


def test_missing_bpe_file_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps open_clip_torch"):
        clip_tokenizer()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        clip_tokenizer("/nonexistent/tokenizer")


# ---------------------------------------------------------------------- v1: CLIP via transformers


def transformers_model(encoder: FrozenCLIPEmbedder) -> CLIPTextModel:
    """The installed transformers' CLIPTextModel inside the encoder (under the `text_model.`
    level we add for transformers >= 5.6)."""
    clip = encoder.transformer
    return clip if isinstance(clip, CLIPTextModel) else clip.text_model


def test_clip_embedder_matches_plain_transformers_model():
    torch.manual_seed(0)
    encoder = FrozenCLIPEmbedder(config=TINY_CLIP)
    reference = CLIPTextModel(CLIPTextConfig(**{**CLIP_VIT_L14_TEXT_CONFIG, **TINY_CLIP})).eval()
    reference.load_state_dict(transformers_model(encoder).state_dict(), strict=True)
    prompts = PROMPTS[:2]
    tokens = encoder.tokenize(prompts)
    with torch.no_grad():
        context = encoder(prompts)
        expected = reference(input_ids=tokens, output_hidden_states=True)
    assert context.shape == (2, 77, 32)
    torch.testing.assert_close(context, expected.last_hidden_state)

    encoder.layer, encoder.layer_idx = "hidden", -2  # "CLIP skip 2": no final LayerNorm
    torch.testing.assert_close(encoder(prompts), expected.hidden_states[-2])
    encoder.layer = "pooled"
    pooled = encoder(prompts)
    assert pooled.shape == (2, 1, 32)
    eot_position = (tokens == EOT).int().argmax(dim=1)
    torch.testing.assert_close(pooled[:, 0], expected.last_hidden_state[[0, 1], eot_position])


def test_clip_embedder_loads_a_local_folder(tmp_path, tokenizer):
    torch.manual_seed(1)
    saved = CLIPTextModel(CLIPTextConfig(**{**CLIP_VIT_L14_TEXT_CONFIG, **TINY_CLIP}))
    saved.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    encoder = FrozenCLIPEmbedder(version=str(tmp_path))
    for name, value in saved.state_dict().items():
        assert torch.equal(transformers_model(encoder).state_dict()[name], value), name
    assert encoder.tokenize(["a photo of a cat"])[0, :7].tolist() == [
        SOT,
        320,
        1125,
        539,
        320,
        2368,
        EOT,
    ]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"version": "openai/clip-vit-base-patch32"}, "downloads nothing"),
        ({"layer": "penultimate"}, "layer"),
        ({"layer": "hidden"}, "layer_idx"),
        ({"layer": "hidden", "layer_idx": 4}, "layer_idx"),
    ],
)
def test_clip_embedder_bad_params_name_the_key(params, message):
    with pytest.raises(ValueError, match=message):
        FrozenCLIPEmbedder(config=TINY_CLIP, **params)


def test_freeze_turns_off_gradients_and_training_mode():
    frozen = FrozenCLIPEmbedder(config=TINY_CLIP)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    trainable = FrozenOpenCLIPEmbedder(freeze=False, **TINY_OPENCLIP)
    assert all(p.requires_grad for p in trainable.parameters())
    trainable(["a cat"]).sum().backward()
    assert trainable.model.token_embedding.weight.grad is not None


# ------------------------------------------------------------------------- v2: OpenCLIP tower


def test_openclip_attention_matches_torch_multihead_attention():
    torch.manual_seed(2)
    block = FrozenOpenCLIPEmbedder(**TINY_OPENCLIP).model.transformer.resblocks[0]
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    mha.load_state_dict(block.attn.state_dict(), strict=True)  # same names and shapes
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    causal = torch.full((9, 9), float("-inf")).triu(1)  # open_clip's attn_mask
    with torch.no_grad():
        expected = mha(x, x, x, attn_mask=causal, need_weights=False)[0]
        torch.testing.assert_close(block.attn(x), expected)


def test_openclip_layers_shapes_and_causality():
    torch.manual_seed(4)
    encoder = FrozenOpenCLIPEmbedder(**TINY_OPENCLIP)
    tokens = encoder.tokenize(["a photo of a cat", "a photo of a dog"])
    assert tokens[:, 5].tolist() == [2368, 1929]  # "cat</w>", "dog</w>": first difference
    with torch.no_grad():
        penultimate = encoder(["a photo of a cat", "a photo of a dog"])
        assert penultimate.shape == (2, 77, 32)
        torch.testing.assert_close(penultimate[0, :5], penultimate[1, :5])  # causal mask
        assert not torch.allclose(penultimate[0, 5:], penultimate[1, 5:])

        model = encoder.model
        x = model.token_embedding(tokens) + model.positional_embedding
        for block in model.transformer.resblocks[:-1]:
            x = block(x)
        torch.testing.assert_close(penultimate, model.ln_final(x))
        encoder.layer = "last"
        last = encoder(["a photo of a cat", "a photo of a dog"])
        torch.testing.assert_close(last, model.ln_final(model.transformer.resblocks[-1](x)))
        assert not torch.allclose(last, penultimate)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"arch": "ViT-Q-99"}, "arch"),
        ({"layer": "pooled"}, "layer"),
        ({"max_length": 78}, "max_length"),
        ({"version": __file__}, "version"),
    ],
)
def test_openclip_bad_params_name_the_key(params, message):
    with pytest.raises(ValueError, match=message):
        FrozenOpenCLIPEmbedder(**{**TINY_OPENCLIP, **params})
