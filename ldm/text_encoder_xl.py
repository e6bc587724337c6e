"""SDXL's second text encoder: the OpenCLIP ViT-bigG/14 text tower with its pooled output.

SDXL (Podell et al. 2023, arXiv:2307.01952, sec. 2.1) conditions on two text encoders: CLIP
ViT-L (`ldm.text_encoder.FrozenCLIPEmbedder` with `layer: hidden, layer_idx: 11`) and OpenCLIP
ViT-bigG, both at their penultimate layer, concatenated along channels (768 + 1280 = 2048), plus
bigG's pooled and projected text embedding in the `vector` input. The tower is the v2 one
(`ldm.text_encoder.OpenCLIPTextTransformer`, original OpenCLIP names under `model.`); this file
adds what sgm's `FrozenOpenCLIPEmbedder2` returns.
"""

import torch

from ldm.text_encoder import FrozenOpenCLIPEmbedder


class FrozenOpenCLIPEmbedder2(FrozenOpenCLIPEmbedder):
    """sgm's `FrozenOpenCLIPEmbedder2`: OpenCLIP text features and the pooled text embedding.

    `layer: penultimate` is the input of the last block, without `ln_final` (unlike the v2
    encoder, which applies it); the pooled output is `ln_final` of the last block's output at
    the <eot> token (the largest id, so `argmax`), times `text_projection` (CLIP's `x @ P`).

    Args (beside those of `FrozenOpenCLIPEmbedder`; SDXL: arch "ViT-bigG-14"):
        always_return_pooled: return (features (B, L, width), pooled (B, embed_dim)).
        legacy: the v2 behaviour (ln_final on the chosen layer, no pooled output); SDXL: False.
    """

    def __init__(
        self,
        arch: str = "ViT-bigG-14",
        *args,
        always_return_pooled: bool = False,
        legacy: bool = True,
        **kwargs,
    ):
        super().__init__(arch, *args, **kwargs)
        if legacy and always_return_pooled:
            raise ValueError("always_return_pooled needs legacy: false (sgm's rule)")
        self.always_return_pooled, self.legacy = always_return_pooled, legacy

    @property
    def field_widths(self) -> dict[str, int]:
        """The features' width, and with the pooled output its `embed_dim` (`vector`)."""
        if not self.always_return_pooled:
            return super().field_widths
        return {"crossattn": self.width, "vector": self.model.text_projection.shape[1]}

    def encode_with_transformer(self, tokens: torch.Tensor):
        if self.legacy:
            return super().encode_with_transformer(tokens)
        model = self.model
        x = model.token_embedding(tokens) + model.positional_embedding[: tokens.shape[1]]
        *first, last = model.transformer.resblocks
        for block in first:
            x = block(x)  # (B, L, width)
        penultimate = x
        x = last(x)
        features = penultimate if self.layer == "penultimate" else x
        if not self.always_return_pooled:
            return features  # (B, L, width)
        eot = x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)]  # (B, width)
        pooled = model.ln_final(eot) @ model.text_projection  # (B, embed_dim)
        return features, pooled

    def blocks_read(self) -> int:
        """The pooled output reads the last block, so with it all of them (LoRA targets)."""
        return (
            len(self.model.transformer.resblocks)
            if self.always_return_pooled
            else super().blocks_read()
        )
