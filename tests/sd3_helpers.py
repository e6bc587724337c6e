"""A tiny SD3 text side, offline: a T5 tokenizer made from a toy unigram vocabulary with the
`tokenizers` library (the shape of google/t5-v1_1-xxl's: SentencePiece pieces with the "▁" word
marker, <pad> 0, </s> 1, <unk> 2, </s> appended), a tiny random T5EncoderModel saved as a
transformers folder, and the tiny conditioner's arguments (shared by the SD3 tests)."""

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

# Toy widths: CLIP-L 16 + bigG 24 = 40 channels, padded to T5's 48; pooled 16 + 24 = 40.
CLIP_L = {"config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3, "projection_dim": 16,
                     "num_attention_heads": 2}}  # fmt: skip
CLIP_G = {"config": {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 3,
                     "num_attention_heads": 2, "projection_dim": 24}}  # fmt: skip
T5_CONFIG = {"d_model": 48, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 2}
T5_TOKENS = 12
CONTEXT_DIM, POOLED_DIM = 48, 40


def t5_tokenizer_folder(folder: Path) -> Path:
    """A T5-like fast tokenizer saved with save_pretrained (tokenizer.json + configs)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in ("a", "photo", "of", "cat", "dog", "red", "blue")]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def t5_model_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny random T5EncoderModel (T5 v1.1's gated-GELU) saved as a transformers folder."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=64, feed_forward_proj="gated-gelu", dropout_rate=0.0, **T5_CONFIG)
    T5EncoderModel(config).save_pretrained(folder)
    t5_tokenizer_folder(folder)
    return folder


def tiny_conditioner_params(t5_tokenizer: Path | None, **extra) -> dict:
    """SD3Conditioner arguments at toy size: random CLIPs, a random T5 from `T5_CONFIG` read
    with the tokenizer folder (None: no T5)."""
    t5 = None
    if t5_tokenizer is not None:
        t5 = {"tokenizer": str(t5_tokenizer), "config": {**T5_CONFIG, "vocab_size": 64}}
    return {
        "clip_l": CLIP_L,
        "clip_g": CLIP_G,
        "t5xxl": t5,
        "t5_tokens": T5_TOKENS,
        "context_dim": CONTEXT_DIM,
        **extra,
    }
