"""Frozen text encoders of Stable Diffusion and their offline CLIP tokenizer.

- v1: `FrozenCLIPEmbedder` = OpenAI CLIP ViT-L/14 text tower (Radford et al. 2021,
  arXiv:2103.00020) as a Hugging Face `CLIPTextModel` under `self.transformer`.
- v2: `FrozenOpenCLIPEmbedder` = OpenCLIP ViT-H/14 text tower (Cherti et al. 2023,
  arXiv:2212.07143), written here with the original OpenCLIP parameter names under `self.model`.

Nothing is downloaded: the weights come from the SD checkpoint (or a local folder), and the
tokenizer is built from the CLIP BPE merges file `bpe_simple_vocab_16e6.txt.gz`, which ships inside
the `open_clip_torch` wheel (installed with `--no-deps`; open_clip itself is never imported).
Checkpoint names: transformers >= 5.6 calls the v1 weights `embeddings.*`, the original
checkpoints `text_model.embeddings.*`; `with_text_model_level` gives every version the original
names. Both encoders are `TextEmbedder`s: captions -> `crossattn`, with caption dropout.
"""

import gzip
import html
import importlib.util
import json
import math
import os
import re
import tempfile
from collections import OrderedDict
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, PreTrainedModel

from ldm.adapters import AdapterTargets
from ldm.conditioning import TextEmbedder

BPE_VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
START_OF_TEXT, END_OF_TEXT = "<|startoftext|>", "<|endoftext|>"
# CLIP's SimpleTokenizer keeps the first 49152 - 256 - 2 merges (after the version line), so
# that 256 bytes + 256 end-of-word bytes + merges + 2 special tokens make 49408 ids.
NUM_BPE_MERGES = 49152 - 256 - 2

# OpenAI CLIP ViT-L/14 text tower (the SD v1 text encoder), for a random-init build whose
# weights then come from the SD checkpoint.
CLIP_VIT_L14_TEXT_CONFIG = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
}
# Hub ids the original configs name; they mean "this architecture", never a download here.
CLIP_VIT_L14_HUB_IDS = (None, "openai/clip-vit-large-patch14")

# OpenCLIP text towers (open_clip/model_configs/<arch>.json, `text_cfg` and `embed_dim`).
# The layers LoRA may adapt (kohya's `lora_te_` modules): attention and MLP of each block.
CLIP_LORA_LAYERS = r"(^|\.)encoder\.layers\.(\d+)\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
OPENCLIP_LORA_LAYERS = r"transformer\.resblocks\.(\d+)\.(attn\.out_proj|mlp\.c_fc|mlp\.c_proj)"
OPENCLIP_TEXT_ARCHS = {
    "ViT-L-14": {"width": 768, "layers": 12, "heads": 12, "embed_dim": 768},
    "ViT-H-14": {"width": 1024, "layers": 24, "heads": 16, "embed_dim": 1024},
    "ViT-bigG-14": {"width": 1280, "layers": 32, "heads": 20, "embed_dim": 1280},
}
OPENCLIP_VOCAB_SIZE, OPENCLIP_CONTEXT_LENGTH = 49408, 77


# --------------------------------------------------------------------------------- tokenizer


def bpe_vocab_path() -> str:
    """Path of the CLIP BPE merges file inside the installed open_clip package (not imported)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], BPE_VOCAB_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"CLIP tokenizer: the BPE vocabulary {BPE_VOCAB_FILE} was not found. Install it with "
        "`pip install --no-deps open_clip_torch` (see requirements-vocab.txt), or set "
        "`cond_stage_config.params.tokenizer` to a local folder holding a CLIP tokenizer "
        "(vocab.json + merges.txt)."
    )


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2's reversible map from the 256 bytes to printable unicode characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = printable[:]
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + shifted)
            shifted += 1
    return dict(zip(printable, [chr(c) for c in codes]))


@lru_cache(maxsize=4)
def clip_vocab_and_merges(bpe_path: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """The token -> id table and merge rules, built exactly as CLIP's SimpleTokenizer does."""
    with gzip.open(bpe_path, "rt", encoding="utf-8") as f:
        merges = tuple(f.read().split("\n")[1 : NUM_BPE_MERGES + 1])
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    tokens += [merge.replace(" ", "") for merge in merges]
    tokens += [START_OF_TEXT, END_OF_TEXT]
    return {token: i for i, token in enumerate(tokens)}, merges


def clip_tokenizer(path: str | None = None) -> CLIPTokenizer:
    """An offline CLIP tokenizer: from the local folder `path`, else from the BPE file.

    The BPE build writes `vocab.json` + `merges.txt` (the Hugging Face layout) to a temporary
    folder and loads it (about 0.2 s); ids equal OpenAI CLIP's, e.g. "a photo of a cat" ->
    49406 320 1125 539 320 2368 49407. Padding uses <|endoftext|> (49407), like SD v1.
    """
    if path is not None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"CLIP tokenizer folder '{path}' does not exist")
        return CLIPTokenizer.from_pretrained(path, local_files_only=True)
    return _bpe_tokenizer(bpe_vocab_path())


def clip_tokenizer_folder(version: str | None, tokenizer: str | None) -> str | None:
    """The tokenizer folder FrozenCLIPEmbedder reads: `tokenizer`, else the `version` folder when
    it holds one, else None (the BPE file)."""
    if tokenizer is None and version not in CLIP_VIT_L14_HUB_IDS:
        has_tokenizer = any(
            os.path.isfile(os.path.join(version, name)) for name in ("vocab.json", "tokenizer.json")
        )
        tokenizer = version if has_tokenizer else None
    return tokenizer


@lru_cache(maxsize=2)
def _bpe_tokenizer(bpe_path: str) -> CLIPTokenizer:
    """Built once per process and shared (read only: every call passes its own padding and
    truncation); SDXL's two encoders and each test model would otherwise spend ~1 s each."""
    vocab, merges = clip_vocab_and_merges(bpe_path)
    with tempfile.TemporaryDirectory(prefix="lun_clip_tokenizer_") as folder:
        with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
        # 77 = CLIP's context length; written into tokenizer_config.json when a pipeline is saved.
        return CLIPTokenizer.from_pretrained(folder, local_files_only=True, model_max_length=77)


def open_clip_tokenize(tokenizer, texts: list[str], context_length: int = 77) -> torch.Tensor:
    """Token ids as `open_clip.tokenize` makes them: <sot> tokens <eot> then zeros, (B, context_length).

    Too long a text is cut to context_length with <eot> kept last. The zero padding (not 49407,
    unlike v1) matters: with a causal mask it changes nothing before <eot>, but the positions
    after it - which SD v2's cross-attention sees - differ. HTML entities are unescaped as
    open_clip's `basic_clean` does (its ftfy repair of mis-decoded text is not applied).
    """
    texts = [html.unescape(html.unescape(text)) for text in texts]
    ids = tokenizer(texts, truncation=True, max_length=context_length)["input_ids"]
    tokens = torch.zeros(len(ids), context_length, dtype=torch.long)
    for row, text_ids in zip(tokens, ids):
        row[: len(text_ids)] = torch.tensor(text_ids, dtype=torch.long)
    return tokens


# ---------------------------------------------------------------------------- shared freezing


class TextModelLevel(nn.Module):
    """Holds a transformers >= 5.6 `CLIPTextModel` as `text_model`, the level that older
    transformers (and every original checkpoint) have: `transformer.text_model.embeddings.*`."""

    def __init__(self, text_model: CLIPTextModel):
        super().__init__()
        self.text_model = text_model
        self.config = text_model.config

    def forward(self, **kwargs):
        return self.text_model(**kwargs)


def with_text_model_level(clip: CLIPTextModel) -> nn.Module:
    """The CLIP text model with parameter names `text_model.*` on every transformers version,
    so that `state_dict()` is the original layout without renaming hooks."""
    return clip if hasattr(clip, "text_model") else TextModelLevel(clip)


# -------------------------------------------------------------------------- v1: OpenAI CLIP


class FrozenCLIPEmbedder(TextEmbedder):
    """SD v1 conditioning: CLIP ViT-L/14 text features, (B, max_length, 768).

    Args:
        version: a LOCAL folder holding a Hugging Face CLIPTextModel (loaded offline); None or
            "openai/clip-vit-large-patch14" builds ViT-L/14 with random weights, to be filled
            from the SD checkpoint. Other names are refused (nothing is downloaded).
        max_length: tokens per prompt, padded with <|endoftext|> (77 in SD).
        freeze: no gradients and eval mode (SD default); False makes the encoder trainable.
        layer: "last" = last_hidden_state after the final LayerNorm (SD v1); "pooled" = the
            <eot> feature as (B, 1, width); "hidden" = output of block `layer_idx` (negative
            counts from the end, -2 = "CLIP skip 2"), without the final LayerNorm, as the original.
        layer_idx: index into hidden_states (0 = embeddings) when layer == "hidden".
        config: CLIPTextConfig overrides for the random-init build (tiny test models).
        tokenizer: local CLIP tokenizer folder; default: `version` if it holds one, else the
            BPE file from the open_clip_torch wheel.
        ucg_rate: probability of training on the empty caption (classifier-free guidance).
        device: accepted from the original configs and ignored (Lightning places modules).
    """

    LAYERS = ("last", "pooled", "hidden")

    def __init__(
        self,
        version: str | None = "openai/clip-vit-large-patch14",
        max_length: int = 77,
        freeze: bool = True,
        layer: str = "last",
        layer_idx: int | None = None,
        config: dict | None = None,
        tokenizer: str | None = None,
        ucg_rate: float = 0.0,
        device=None,
    ):
        super().__init__(ucg_rate=ucg_rate, trainable=not freeze)
        if layer not in self.LAYERS:
            raise ValueError(f"cond_stage_config.params.layer: '{layer}' not in {self.LAYERS}")
        self.transformer = with_text_model_level(self._build_transformer(version, config))
        num_layers = self.transformer.config.num_hidden_layers
        if layer == "hidden" and (layer_idx is None or abs(layer_idx) > num_layers):
            raise ValueError(
                f"cond_stage_config.params.layer_idx: {layer_idx} must be an int in "
                f"[-{num_layers}, {num_layers}] when layer is 'hidden'"
            )
        self.tokenizer = clip_tokenizer(clip_tokenizer_folder(version, tokenizer))
        self.max_length = max_length
        self.layer, self.layer_idx = layer, layer_idx
        if freeze:
            self.freeze()

    @staticmethod
    def _build_transformer(version: str | None, config: dict | None) -> CLIPTextModel:
        if version in CLIP_VIT_L14_HUB_IDS:
            return CLIPTextModel(CLIPTextConfig(**{**CLIP_VIT_L14_TEXT_CONFIG, **(config or {})}))
        if not os.path.isdir(version):
            raise ValueError(
                f"cond_stage_config.params.version: '{version}' is not a local folder; "
                "lun-diffusion downloads nothing. Give a folder with a Hugging Face "
                "CLIPTextModel, or leave it unset to take the weights from the SD checkpoint."
            )
        if config:
            raise ValueError(
                "cond_stage_config.params.config only shapes the random-init model; "
                f"remove it or unset version ('{version}')"
            )
        return CLIPTextModel.from_pretrained(version, local_files_only=True)

    @property
    def width(self) -> int:
        """The features' width (`hidden_size`: 768 for ViT-L/14), every `layer` alike."""
        return self.transformer.config.hidden_size

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """(B, max_length) ids: <sot> tokens <eot>, padded with <eot> (49407), as the original."""
        batch = self.tokenizer(
            list(texts),
            truncation=True,
            max_length=self.max_length,
            padding="max_length",
            return_tensors="pt",
        )
        return batch["input_ids"]

    def forward(self, texts: list[str]) -> torch.Tensor:
        device = self.transformer.text_model.embeddings.token_embedding.weight.device
        tokens = self.tokenize(texts).to(device)  # (B, L)
        outputs = self.transformer(input_ids=tokens, output_hidden_states=self.layer == "hidden")
        if self.layer == "last":
            return outputs.last_hidden_state  # (B, L, width)
        if self.layer == "pooled":
            return outputs.pooler_output[:, None, :]  # (B, 1, width)
        return outputs.hidden_states[self.layer_idx]  # (B, L, width)

    def lora_targets(self) -> list[AdapterTargets]:
        """kohya's `lora_te_` layers (q/k/v/out projections, fc1/fc2) of the encoder layers the
        output reads: `layer: hidden` at index k reads the first k (hidden_states[k] is the
        output of layer k - 1; SDXL's layer_idx 11 leaves the last of 12 out) - adapters on the
        others would get no gradient, which DDP refuses. peft is given the transformers model
        itself (it reads the library's conversion rules from it)."""
        clip = next(m for m in self.transformer.modules() if isinstance(m, PreTrainedModel))
        layers = clip.config.num_hidden_layers
        used = self.layer_idx % (layers + 1) if self.layer == "hidden" else layers
        return [AdapterTargets(clip, clip_lora_layers(clip, used), tower=self)]


def clip_lora_layers(text_model: nn.Module, used_layers: int | None = None) -> list[str]:
    """Names (in a CLIP text model) of kohya's `lora_te_` layers (attention and MLP), of its
    first `used_layers` encoder layers (default all)."""
    found = [(n, re.search(CLIP_LORA_LAYERS + "$", n)) for n, m in text_model.named_modules()]
    return [n for n, f in found if f and int(f[2]) < (used_layers or math.inf)]


# ---------------------------------------------------------------------- v2: OpenCLIP ViT-H/14


class MultiheadSelfAttention(nn.Module):
    """Causal self-attention with the parameters of `nn.MultiheadAttention` (packed q/k/v)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, width = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, L, 3W)
        qkv = qkv.reshape(b, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        # is_causal = OpenCLIP's additive `attn_mask` (-inf above the diagonal).
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (B, h, L, d)
        return self.out_proj(out.transpose(1, 2).reshape(b, length, width))  # (B, L, W)


class ResidualAttentionBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)), GELU MLP x4."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = MultiheadSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                c_fc=nn.Linear(width, 4 * width),
                gelu=nn.GELU(),
                c_proj=nn.Linear(4 * width, width),
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, L, W)
        return x + self.mlp(self.ln_2(x))  # (B, L, W)


class OpenCLIPTextTransformer(nn.Module):
    """The text half of an OpenCLIP model, with its names (`cond_stage_model.model.*` in SD v2).

    `text_projection` and `logit_scale` are unused for conditioning but are in the checkpoints.
    """

    def __init__(self, width: int, layers: int, heads: int, embed_dim: int):
        super().__init__()
        self.token_embedding = nn.Embedding(OPENCLIP_VOCAB_SIZE, width)
        self.positional_embedding = nn.Parameter(torch.empty(OPENCLIP_CONTEXT_LENGTH, width))
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList(
            ResidualAttentionBlock(width, heads) for _ in range(layers)
        )
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.empty(width, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self._init_weights(width, layers)

    def _init_weights(self, width: int, layers: int) -> None:
        """OpenCLIP's TextTransformer.init_parameters (GPT-2 style depth-scaled projections)."""
        proj_std = width**-0.5 * (2 * layers) ** -0.5
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for block in self.transformer.resblocks:
            nn.init.normal_(block.attn.in_proj_weight, std=width**-0.5)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.zeros_(block.attn.out_proj.bias)
            nn.init.normal_(block.mlp.c_fc.weight, std=(2 * width) ** -0.5)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=width**-0.5)

    def forward(self, tokens: torch.Tensor, skip_last_blocks: int = 0) -> torch.Tensor:
        """(B, L) ids -> ln_final of the output of all but the last `skip_last_blocks` blocks."""
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[1]]  # (B, L, W)
        for block in self.transformer.resblocks[
            : len(self.transformer.resblocks) - skip_last_blocks
        ]:
            x = block(x)
        return self.ln_final(x)  # (B, L, W)


class FrozenOpenCLIPEmbedder(TextEmbedder):
    """SD v2 conditioning: OpenCLIP text features, (B, max_length, width) = (B, 77, 1024) for ViT-H-14.

    Args:
        arch: OpenCLIP architecture name, one of OPENCLIP_TEXT_ARCHS (SD v2: "ViT-H-14").
        version: the OpenCLIP pretrained tag of the original config (e.g. "laion2b_s32b_b79k");
            informational only - weights come from the SD checkpoint, nothing is downloaded.
        max_length: tokens per prompt, <= 77; padded with zeros after <eot> as open_clip does.
        freeze: no gradients and eval mode (SD default); False makes the encoder trainable.
        layer: "penultimate" (SD v2: skip the last block, then ln_final) or "last" (all blocks).
        width, layers, heads, embed_dim: override the arch's sizes (tiny test models).
        tokenizer: local CLIP tokenizer folder; default: the BPE file from open_clip_torch.
        ucg_rate: probability of training on the empty caption (classifier-free guidance).
        device: accepted from the original configs and ignored (Lightning places modules).
    """

    LAYERS = {"last": 0, "penultimate": 1}  # -> number of final blocks skipped

    def __init__(
        self,
        arch: str = "ViT-H-14",
        version: str | None = None,
        max_length: int = 77,
        freeze: bool = True,
        layer: str = "penultimate",
        width: int | None = None,
        layers: int | None = None,
        heads: int | None = None,
        embed_dim: int | None = None,
        tokenizer: str | None = None,
        ucg_rate: float = 0.0,
        device=None,
    ):
        super().__init__(ucg_rate=ucg_rate, trainable=not freeze)
        if arch not in OPENCLIP_TEXT_ARCHS:
            raise ValueError(
                f"cond_stage_config.params.arch: '{arch}' not in {sorted(OPENCLIP_TEXT_ARCHS)}"
            )
        if layer not in self.LAYERS:
            raise ValueError(
                f"cond_stage_config.params.layer: '{layer}' not in {list(self.LAYERS)}"
            )
        if version is not None and os.path.exists(version):
            raise ValueError(
                f"cond_stage_config.params.version: '{version}' is a file; OpenCLIP weights "
                "are loaded with the SD checkpoint (cond_stage_model.model.*), not from here"
            )
        if not 0 < max_length <= OPENCLIP_CONTEXT_LENGTH:
            raise ValueError(f"cond_stage_config.params.max_length: {max_length} not in 1..77")
        sizes = dict(OPENCLIP_TEXT_ARCHS[arch])
        overrides = {"width": width, "layers": layers, "heads": heads, "embed_dim": embed_dim}
        sizes.update({k: v for k, v in overrides.items() if v is not None})
        self.model = OpenCLIPTextTransformer(**sizes)
        self.tokenizer = clip_tokenizer(tokenizer)
        self.max_length = max_length
        self.layer = layer
        if freeze:
            self.freeze()

    @property
    def width(self) -> int:
        """The features' width (the arch's `width`: 1024 for ViT-H-14)."""
        return self.model.token_embedding.embedding_dim

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """(B, max_length) ids as open_clip.tokenize: <sot> tokens <eot> 0 0 ..."""
        return open_clip_tokenize(self.tokenizer, texts, self.max_length)

    def encode_with_transformer(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, L, width) features of the configured layer."""
        return self.model(tokens, skip_last_blocks=self.LAYERS[self.layer])

    def forward(self, texts: list[str]) -> torch.Tensor:
        tokens = self.tokenize(texts).to(self.model.token_embedding.weight.device)  # (B, L)
        return self.encode_with_transformer(tokens)  # (B, L, width)

    def blocks_read(self) -> int:
        """How many of the blocks the output reads: SD 2.x's penultimate layer leaves the last
        one out (as kohya's and diffusers' 23-layer CLIPTextModel of it do)."""
        return len(self.model.transformer.resblocks) - self.LAYERS[self.layer]

    def lora_targets(self) -> list[AdapterTargets]:
        """The attention output and MLP layers and the fused q/k/v weight of the blocks read
        (`openclip_lora_layers`); peft adapts a fused weight with plain LoRA only."""
        linears, fused = openclip_lora_layers(self.model, self.blocks_read())
        why = (
            "the OpenCLIP text encoder (SD 2.x) takes plain LoRA (its fused q/k/v weight has "
            "no dropout or DoRA in peft)"
        )
        return [AdapterTargets(self.model, linears, fused, plain_only=why, tower=self)]


def openclip_lora_layers(tower: nn.Module, used_blocks: int) -> tuple[list[str], list[str]]:
    """Names (in an OpenCLIP text tower) of the LoRA layers of its first `used_blocks` blocks:
    the Linear layers (attention output, MLP) and the fused q/k/v weights (`attn.in_proj_weight`,
    a parameter: peft's `target_parameters`, one LoRA of the stacked q/k/v rows)."""
    found = [re.fullmatch(OPENCLIP_LORA_LAYERS, n) for n, m in tower.named_modules()]
    linears = [f[0] for f in found if f and int(f[1]) < used_blocks]
    fused = [f"transformer.resblocks.{i}.attn.in_proj_weight" for i in range(used_blocks)]
    return linears, fused


def tokenizer_of(cls, params: dict) -> tuple[str | None, bool] | None:
    """(tokenizer folder, unescapes HTML first) of the CLIP / OpenCLIP text encoder `cls` would
    build from `params`, None when `cls` is no such encoder: for readers of a model config that
    build nothing (the dataset report counts tokens; lun/data imports no model class)."""
    if not isinstance(cls, type):
        return None
    if issubclass(cls, FrozenCLIPEmbedder):
        version = params.get("version", "openai/clip-vit-large-patch14")
        return clip_tokenizer_folder(version, params.get("tokenizer")), False
    if issubclass(cls, FrozenOpenCLIPEmbedder):
        # open_clip_tokenize unescapes HTML entities twice before tokenizing
        return params.get("tokenizer"), True
    return None
