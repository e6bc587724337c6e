"""T5-XXL, the third text encoder of Stable Diffusion 3 / 3.5 (Esser et al. 2024, sec. 5.3.3).

Google's T5 v1.1 XXL encoder (Raffel et al. 2020, arXiv:1910.10683; v1.1: gated-GELU MLP, no
tied LM head) as transformers' `T5EncoderModel` under `self.transformer`, so that its names are
those of Stability's single files (`text_encoders.t5xxl.transformer.*`). Its input is the
caption cut and padded to `max_length` tokens (256, diffusers' `max_sequence_length`) with the
pad id 0 and no attention mask, as both Stability's sd3.5 reference (`other_impls.py`) and
diffusers' StableDiffusion3Pipeline run it; the output is the last hidden state after the final
RMS norm, (B, max_length, 4096).

Nothing is downloaded: the weights come from a LOCAL folder (`version`) or from the SD3 file
(`version: null` builds the XXL structure for them), and the tokenizer always from a local
folder (the `tokenizer/` of a T5 or SD3 diffusers folder).
"""

import os

import torch
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from ldm.conditioning import TextEmbedder

# google/t5-v1_1-xxl's encoder (Stability's sd3_infer.py T5_CONFIG; diffusers' text_encoder_3).
T5_XXL_CONFIG = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.0,
    "is_encoder_decoder": False,
    "use_cache": False,
}
TIED_EMBEDDING = "encoder.embed_tokens.weight"  # the same tensor as `shared.weight`


class FrozenT5Embedder(TextEmbedder):
    """Captions -> T5 encoder features (B, max_length, d_model).

    Args:
        version: a LOCAL folder holding a transformers T5EncoderModel (config.json + weights);
            None builds T5 v1.1 XXL (or `config`) with random weights, filled from the SD3 file.
        tokenizer: a LOCAL folder with the T5 tokenizer (spiece.model or tokenizer.json);
            default: `version`.
        max_length: tokens per caption, padded with id 0 (256; SD3 was trained with 77 to 256).
        freeze: no gradients and eval mode (the SD3 default).
        config: T5Config overrides for the random-init build (tiny test models).
        key: the config key this encoder is built from, named in error messages.
    """

    def __init__(
        self,
        version: str | None = None,
        tokenizer: str | None = None,
        max_length: int = 256,
        freeze: bool = True,
        config: dict | None = None,
        key: str = "conditioner_config.params.t5xxl",
    ):
        super().__init__(ucg_rate=0.0, trainable=not freeze)
        if max_length < 1:
            raise ValueError(f"{key}.max_length: {max_length} must be >= 1")
        if version is not None and not os.path.isdir(version):
            raise ValueError(
                f"{key}.version: the folder '{version}' does not exist; give a local folder "
                "with a T5EncoderModel (text_encoder_3/ of an SD3 diffusers model), or leave "
                "it unset to take T5's weights from the SD3 file"
            )
        tokenizer = tokenizer or version
        if tokenizer is None:
            raise ValueError(
                f"{key}.tokenizer: not set; give a local folder with the T5-XXL tokenizer "
                "(the tokenizer_3/ folder of an SD3 diffusers model), nothing is downloaded"
            )
        if not os.path.isdir(tokenizer):
            raise ValueError(
                f"{key}.tokenizer: the folder '{tokenizer}' does not exist; give a local "
                "folder with the T5-XXL tokenizer (tokenizer_3/ of an SD3 diffusers model)"
            )
        # The folders are checked before T5-XXL (19 GB in fp32) is built.
        self.transformer = self._build(version, config, key)
        self.from_folder = version is not None  # its weights need not be in the SD3 file
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        self.max_length = max_length
        # Stability's files hold the embedding once (`shared.weight`); transformers ties it to
        # `encoder.embed_tokens.weight`, so that name is left out of the state dict and filled
        # from `shared.weight` when loading.
        self._register_state_dict_hook(_without_tied_embedding)
        self.register_load_state_dict_pre_hook(_tie_embedding)
        if freeze:
            self.freeze()

    @staticmethod
    def _build(version: str | None, config: dict | None, key: str) -> T5EncoderModel:
        if version is None:
            return T5EncoderModel(T5Config(**{**T5_XXL_CONFIG, **(config or {})}))
        if config:
            raise ValueError(f"{key}.config only shapes the random-init model; remove it")
        return T5EncoderModel.from_pretrained(version, local_files_only=True)

    @property
    def width(self) -> int:
        return self.transformer.config.d_model

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """(B, max_length) ids: the caption's pieces, </s> (1), then pad (0); too long a caption
        is cut with </s> kept last (diffusers' SD3 pipeline)."""
        batch = self.tokenizer(
            list(texts),
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return batch["input_ids"]

    def forward(self, texts: list[str]) -> torch.Tensor:
        tokens = self.tokenize(texts).to(self.transformer.shared.weight.device)
        return self.transformer(input_ids=tokens).last_hidden_state  # (B, L, d_model)


def _without_tied_embedding(module, state: dict, prefix: str, local_metadata) -> None:
    state.pop(prefix + "transformer." + TIED_EMBEDDING, None)


def _tie_embedding(module, state: dict, prefix: str, *args) -> None:
    """A file without the tied name loads it from `shared.weight` (the same tensor)."""
    shared = state.get(prefix + "transformer.shared.weight")
    if shared is not None:
        state[prefix + "transformer." + TIED_EMBEDDING] = shared
