"""Stable Diffusion 3 / 3.5 conditioning: CLIP-L + OpenCLIP bigG + T5-XXL (Esser et al. 2024).

Three frozen text encoders read the caption (paper sec. 2, fig. 2; Stability's sd3.5
`sd3_infer.py: get_cond`, `other_impls.py`):

- CLIP-L (OpenAI ViT-L/14, 77 tokens padded with <eot>) and OpenCLIP bigG (77 tokens padded with
  0), each its penultimate layer without the final LayerNorm, as SDXL uses them;
- their pooled outputs: CLIP-L's final-LayerNorm <eot> feature *unprojected* (SD3 files carry no
  CLIP-L projection; diffusers loads it as the identity), bigG's projected one;
- T5-XXL's last hidden state (`ldm.text_encoder_t5`), 256 tokens.

They are joined as `get_cond` does:
    crossattn = cat([pad(cat([clip_l, clip_g], channels), to T5's width 4096), t5], tokens)
              = (B, 77 + 256, 4096)
    vector    = cat([pooled clip_l, pooled clip_g], channels) = (B, 768 + 1280 = 2048)
Without T5 (`t5xxl: null`) its tokens are zeros, as the reference and diffusers run SD3 without
it, so the shapes stay those the MMDiT was trained with.

Classifier-free guidance: this conditioner owns the dropout. While training, each of the three
encoders is dropped independently with probability 46.3 % (paper sec. 5.3.3, so that the model
also works without T5 and all three are dropped together 0.463^3 ~ 10 % of the time); a dropped
encoder's tokens and pooled vector are zeros. The unconditional side of sampling is the
encoding of the negative prompt, "" by default (`get_cond("")` in sd3_infer.py, diffusers).

Checkpoint names are Stability's: `text_encoders.{clip_l,clip_g,t5xxl}.transformer.*`, the
transformers layouts of CLIPTextModel, CLIPTextModelWithProjection and T5EncoderModel.
"""

import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from ldm.config_errors import check_whole_numbers
from ldm.text_encoder import (
    CLIP_VIT_L14_TEXT_CONFIG,
    FrozenCLIPEmbedder,
    open_clip_tokenize,
)
from ldm.text_encoder_t5 import FrozenT5Embedder

CAPTION_KEY = "caption"
ENCODERS = ("clip_l", "clip_g", "t5xxl")
DROP_RATE = 0.463  # per encoder, independently (Esser et al. 2024, sec. 5.3.3)
CLIP_TOKENS, T5_TOKENS = 77, 256

# OpenCLIP ViT-bigG/14's text tower in transformers' CLIP names (sd3_infer.py CLIPG_CONFIG).
CLIP_G_TEXT_CONFIG = {
    **CLIP_VIT_L14_TEXT_CONFIG,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "hidden_act": "gelu",
}


class SD3CLIPEmbedder(FrozenCLIPEmbedder):
    """One of SD3's CLIP encoders: captions -> (penultimate hidden states (B, 77, width),
    pooled (B, width)).

    Args (beside FrozenCLIPEmbedder's `version`, `config`, `tokenizer`, `freeze`):
        projection: bigG: the pooled output goes through `text_projection`
            (CLIPTextModelWithProjection); CLIP-L: unprojected.
        pad_with_zeros: bigG: pad after <eot> with id 0 (open_clip / SDXLClipGTokenizer);
            CLIP-L pads with <eot>.
    """

    def __init__(
        self,
        version: str | None = None,
        config: dict | None = None,
        tokenizer: str | None = None,
        freeze: bool = True,
        projection: bool = False,
        pad_with_zeros: bool = False,
    ):
        self.projection, self.pad_with_zeros = projection, pad_with_zeros
        self.from_folder = version is not None
        super().__init__(
            version=version,
            max_length=CLIP_TOKENS,
            freeze=freeze,
            layer="hidden",
            layer_idx=-2,  # penultimate, without the final LayerNorm
            config=config,
            tokenizer=tokenizer,
        )

    def _build_transformer(self, version, config):
        model_class = CLIPTextModelWithProjection if self.projection else CLIPTextModel
        if version is None:
            defaults = CLIP_G_TEXT_CONFIG if self.projection else CLIP_VIT_L14_TEXT_CONFIG
            return model_class(CLIPTextConfig(**{**defaults, **(config or {})}))
        if not os.path.isdir(version):
            raise ValueError(
                f"conditioner_config.params.{'clip_g' if self.projection else 'clip_l'}.version: "
                f"the folder '{version}' does not exist; give a local folder with a "
                f"{model_class.__name__}, or leave it unset to take the weights from the SD3 file"
            )
        return model_class.from_pretrained(version, local_files_only=True)

    @property
    def field_widths(self) -> dict[str, int]:
        """Its tokens' width and its pooled output's: `projection_dim` when projected (bigG),
        else `hidden_size` (CLIP-L)."""
        config = self.transformer.config
        pooled = config.projection_dim if self.projection else config.hidden_size
        return {"crossattn": self.width, "vector": pooled}

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        if self.pad_with_zeros:
            return open_clip_tokenize(self.tokenizer, list(texts), self.max_length)
        return super().tokenize(texts)

    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.transformer.text_model.embeddings.token_embedding.weight.device
        tokens = self.tokenize(texts).to(device)  # (B, 77)
        out = self.transformer(input_ids=tokens, output_hidden_states=True)
        pooled = out.text_embeds if self.projection else out.pooler_output  # (B, width)
        return out.hidden_states[self.layer_idx], pooled  # (B, 77, width), (B, width)


def joint_conditioning(
    clip_l: tuple[torch.Tensor, torch.Tensor],
    clip_g: tuple[torch.Tensor, torch.Tensor],
    t5: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """SD3's layout (sd3_infer.py get_cond): the CLIP tokens side by side, zero-padded to T5's
    width, then the T5 tokens; the pooled vectors side by side (CLIP-L first)."""
    (l_tokens, l_pooled), (g_tokens, g_pooled) = clip_l, clip_g
    lg = torch.cat([l_tokens, g_tokens], dim=-1)  # (B, 77, 768 + 1280)
    lg = F.pad(lg, (0, t5.shape[-1] - lg.shape[-1]))  # (B, 77, 4096)
    return {
        "crossattn": torch.cat([lg, t5.to(lg)], dim=-2),  # (B, 77 + T, 4096)
        "vector": torch.cat([l_pooled, g_pooled], dim=-1),  # (B, 2048)
    }


class SD3Conditioner(nn.Module):
    """Captions -> {"crossattn": (B, 77 + t5_tokens, width), "vector": (B, 2048)}.

    Args:
        clip_l, clip_g: arguments of `SD3CLIPEmbedder` (the CLIP-L / bigG defaults are filled
            in; tiny models give `config`).
        t5xxl: arguments of `ldm.text_encoder_t5.FrozenT5Embedder` (its `tokenizer` folder at
            least), or None: run without T5 (zeros in its place).
        t5_tokens: T5's token count (256); without T5, the count of zero tokens.
        context_dim: the token width (T5's d_model, 4096); needed only without T5.
        drop_rate: per-encoder dropout while training (0.463); `ucg_rate` is its old spelling.
    """

    checkpoint_name = "text_encoders"  # Stability's single files (ldm.checkpoint)
    input_key = CAPTION_KEY
    trainable = False

    def __init__(
        self,
        clip_l: Mapping | None = None,
        clip_g: Mapping | None = None,
        t5xxl: Mapping | None = None,
        t5_tokens: int = T5_TOKENS,
        context_dim: int = 4096,
        drop_rate: float = DROP_RATE,
        ucg_rate: float | None = None,
    ):
        super().__init__()
        drop_rate = drop_rate if ucg_rate is None else ucg_rate
        if not 0.0 <= drop_rate <= 1.0:
            raise ValueError(f"conditioner_config.params.drop_rate: {drop_rate} not in [0, 1]")
        self.drop_rate = float(drop_rate)
        check_whole_numbers(0, t5_tokens=t5_tokens)  # 0: no T5 tokens at all
        self.clip_l = SD3CLIPEmbedder(**dict(clip_l or {}))
        self.clip_g = SD3CLIPEmbedder(
            **{"projection": True, "pad_with_zeros": True, **dict(clip_g or {})}
        )
        key = "conditioner_config.params.t5xxl"
        self.t5xxl = (
            None
            if t5xxl is None
            else FrozenT5Embedder(**{"max_length": t5_tokens, "key": key, **t5xxl})
        )
        self.t5_tokens = t5_tokens if self.t5xxl is None else self.t5xxl.max_length
        self.context_dim = context_dim if self.t5xxl is None else self.t5xxl.width
        self.register_load_state_dict_post_hook(_encoders_from_folders)
        clip_width = self.clip_l.width + self.clip_g.width
        if clip_width > self.context_dim:
            raise ValueError(
                f"conditioner_config.params: CLIP-L + bigG are {clip_width} wide, more than the "
                f"token width {self.context_dim} (T5's d_model / context_dim) they are padded to"
            )

    @property
    def field_widths(self) -> dict[str, int]:
        """`joint_conditioning`'s widths: the token width the CLIP tokens are padded to (T5's),
        and the two pooled vectors side by side."""
        pooled = self.clip_l.field_widths["vector"] + self.clip_g.field_widths["vector"]
        return {"crossattn": self.context_dim, "vector": pooled}

    def train(self, mode: bool = True):
        return super().train(False)  # frozen encoders: no dropout layers active

    def lora_targets(self) -> list:
        """None: SD 3's LoRA files (kohya's, diffusers') hold the MMDiT's adapters only."""
        return []

    def batch_of(self, inputs) -> dict:
        """Prompts given alone -> the batch this conditioner reads."""
        return dict(inputs) if isinstance(inputs, Mapping) else {CAPTION_KEY: list(inputs)}

    def encoders(self, texts: list[str]) -> dict[str, tuple[torch.Tensor, ...]]:
        """Each encoder's outputs for `texts`: clip_l / clip_g (tokens, pooled), t5xxl (tokens,)."""
        with torch.no_grad():
            out = {"clip_l": self.clip_l(texts), "clip_g": self.clip_g(texts)}
            if self.t5xxl is not None:
                out["t5xxl"] = (self.t5xxl(texts),)
            else:
                tokens = out["clip_l"][0]
                out["t5xxl"] = (tokens.new_zeros(len(texts), self.t5_tokens, self.context_dim),)
        return out

    def condition(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]:
        """SD3's conditioning of `batch["caption"]`; with `drop`, each encoder's outputs are
        zeroed per sample with probability `drop_rate`, independently of the others (draws from
        `generator`, else the global CPU generator, in the order clip_l, clip_g, t5xxl)."""
        if CAPTION_KEY not in batch:
            raise KeyError(f"the SD3 conditioner reads batch['{CAPTION_KEY}'], which is missing")
        texts = list(batch[CAPTION_KEY])
        out = self.encoders(texts)
        if drop and self.drop_rate > 0:
            device = generator.device if generator is not None else "cpu"
            for name in ENCODERS:
                dropped = (
                    torch.rand(len(texts), generator=generator, device=device) < self.drop_rate
                )
                out[name] = tuple(zero_rows(x, dropped) for x in out[name])
        return joint_conditioning(out["clip_l"], out["clip_g"], out["t5xxl"][0])

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]:
        """The guidance's unconditional side: the encoding of the negative prompts, of "" where
        there is none (sd3_infer.py, diffusers' StableDiffusion3Pipeline)."""
        n = len(batch[CAPTION_KEY])
        negative = [""] * n if negative is None else [text or "" for text in negative]
        return self.condition({CAPTION_KEY: negative})


def _encoders_from_folders(conditioner: SD3Conditioner, incompatible) -> None:
    encoders_from_folders(conditioner, incompatible, ENCODERS, optional=("t5xxl",))


def encoders_from_folders(
    conditioner: nn.Module, incompatible, encoders: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    """A file without an encoder's weights (sd3.5_large.safetensors holds the MMDiT and the VAE
    only, BFL's flux1-dev the transformer only): an encoder read from its own folder (`version`)
    keeps them; one built for the file's weights is one error line (`optional` encoders may be
    left out: null)."""
    missing = incompatible.missing_keys
    for name in encoders:
        embedder = getattr(conditioner, name)
        if embedder is None:
            continue
        level = f"{conditioner.checkpoint_name}.{name}."
        own = [k for k in missing if k.startswith(level) or k.startswith(name + ".")]
        if not own or len(own) < len(embedder.state_dict()):
            continue  # some of its weights are in the file: strict loading names the rest
        if getattr(embedder, "from_folder", False):
            for key in own:
                missing.remove(key)
        else:
            raise ValueError(
                f"the weights file has no {name} weights ({level}*): set "
                f"conditioner_config.params.{name}.version to a local folder holding them"
                + (f", or {name}: null to run without it" if name in optional else "")
            )


def zero_rows(x: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """x (B, ...) with the rows where `dropped` (B,) is True set to zero."""
    keep = (~dropped).to(device=x.device, dtype=x.dtype)
    return x * keep.view(-1, *[1] * (x.dim() - 1))
