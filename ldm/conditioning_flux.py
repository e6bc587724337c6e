"""Flux.1 conditioning: T5-XXL tokens + the pooled CLIP-L vector (+ dev's guidance scale).

Black Forest Labs' reference (black-forest-labs/flux `src/flux/util.py load_t5/load_clip`,
`modules/conditioner.py HFEmbedder`, `sampling.py prepare`) and diffusers' FluxPipeline
(`encode_prompt`) read the caption twice:

- T5 v1.1 XXL (`ldm.text_encoder_t5`), padded with id 0 to 512 tokens for dev and 256 for
  schnell, no attention mask, its last hidden state -> "crossattn" (B, L, 4096);
- CLIP-L (OpenAI ViT-L/14, 77 tokens padded with <eot>), only its `pooler_output`: the final
  LayerNorm's feature at the <eot> token, unprojected -> "vector" (B, 768). Its token
  features are not used.

FLUX.1 [dev] was distilled from classifier-free guidance and takes the guidance scale as an
input (`guidance_in`). Training feeds the scale the model should imitate; the trainers' default
is 3.5, BFL's and diffusers' sampling default for dev (kohya sd-scripts `flux_train_utils.py
--guidance_scale`, diffusers `train_dreambooth_lora_flux.py --guidance_scale`; kohya's Flux
README also trains LoRAs with 1.0). This conditioner puts it into `cond["guidance"]` (B,);
schnell (`guidance: null`) has no such input.

Classifier-free guidance: this conditioner owns the caption dropout. While training each
sample's caption is replaced by "" with probability `drop_rate` (kohya / ai-toolkit
`caption_dropout_rate`); the unconditional side of sampling is the encoding of the negative
prompt, "" by default. Flux dev normally samples without CFG (scale 1): its guidance is the
embedded scale.

Checkpoint names are those of ComfyUI's all-in-one Flux files:
`text_encoders.{clip_l,t5xxl}.transformer.*`. BFL's `flux1-*.safetensors` hold the transformer
only; encoders read from their own folders (`version`) then keep their weights.
"""

from collections.abc import Mapping

import torch
from torch import nn

from ldm.conditioning_sd3 import SD3CLIPEmbedder, encoders_from_folders
from ldm.text_encoder_t5 import FrozenT5Embedder

CAPTION_KEY = "caption"
ENCODERS = ("clip_l", "t5xxl")
T5_TOKENS = {"dev": 512, "schnell": 256}  # BFL util.py load_t5(max_length=...)
DEV_GUIDANCE = 3.5


class FluxConditioner(nn.Module):
    """Captions -> {"crossattn": (B, t5_tokens, 4096), "vector": (B, 768)[, "guidance": (B,)]}.

    Args:
        clip_l: arguments of `ldm.conditioning_sd3.SD3CLIPEmbedder` (CLIP-L's defaults are
            filled in; a local folder as `version`, or `config` for a tiny random one).
        t5xxl: arguments of `ldm.text_encoder_t5.FrozenT5Embedder` (its `tokenizer` folder at
            least).
        t5_tokens: T5's token count: 512 (dev), 256 (schnell).
        guidance: dev's guidance scale fed while training and sampling (3.5); null for schnell.
        drop_rate: probability of training a sample on the empty caption (CFG dropout).
    """

    checkpoint_name = "text_encoders"  # ComfyUI's all-in-one Flux files (ldm.checkpoint)
    input_key = CAPTION_KEY
    trainable = False

    def __init__(
        self,
        clip_l: Mapping | None = None,
        t5xxl: Mapping | None = None,
        t5_tokens: int = T5_TOKENS["dev"],
        guidance: float | None = DEV_GUIDANCE,
        drop_rate: float = 0.0,
    ):
        super().__init__()
        if not 0.0 <= drop_rate <= 1.0:
            raise ValueError(f"conditioner_config.params.drop_rate: {drop_rate} not in [0, 1]")
        if guidance is not None and guidance < 0:
            raise ValueError(f"conditioner_config.params.guidance: {guidance} must be >= 0")
        if t5xxl is None:
            raise ValueError(
                "conditioner_config.params.t5xxl: Flux needs T5-XXL; give at least its "
                "`tokenizer` folder (and `version`, a local T5EncoderModel folder)"
            )
        self.drop_rate = float(drop_rate)
        self.guidance = None if guidance is None else float(guidance)
        self.clip_l = SD3CLIPEmbedder(**dict(clip_l or {}))
        key = "conditioner_config.params.t5xxl"
        self.t5xxl = FrozenT5Embedder(**{"max_length": t5_tokens, "key": key, **dict(t5xxl)})
        self.register_load_state_dict_post_hook(_encoders_from_folders)

    def train(self, mode: bool = True):
        return super().train(False)  # frozen encoders: no dropout layers active

    @property
    def field_widths(self) -> dict[str, int]:
        """T5's `d_model` (tokens) and CLIP-L's pooled width (`encode`)."""
        return {"crossattn": self.t5xxl.width, "vector": self.clip_l.field_widths["vector"]}

    def lora_targets(self) -> list:
        """None: Flux LoRA files (kohya's, diffusers') hold the transformer's adapters only."""
        return []

    def batch_of(self, inputs) -> dict:
        """Prompts given alone -> the batch this conditioner reads."""
        return dict(inputs) if isinstance(inputs, Mapping) else {CAPTION_KEY: list(inputs)}

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """BFL's `prepare`: T5's last hidden state and CLIP-L's pooled <eot> feature."""
        with torch.no_grad():
            _, pooled = self.clip_l(texts)  # CLIP's token features are not used by Flux
            cond = {"crossattn": self.t5xxl(texts), "vector": pooled}
        if self.guidance is not None:
            cond["guidance"] = torch.full((len(texts),), self.guidance, device=pooled.device)
        return cond

    def condition(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]:
        """Flux's conditioning of `batch["caption"]`; with `drop`, each caption is replaced by
        "" with probability `drop_rate` (draws from `generator`, else the global CPU one)."""
        if CAPTION_KEY not in batch:
            raise KeyError(f"the Flux conditioner reads batch['{CAPTION_KEY}'], which is missing")
        texts = list(batch[CAPTION_KEY])
        if drop and self.drop_rate > 0:
            device = generator.device if generator is not None else "cpu"
            dropped = torch.rand(len(texts), generator=generator, device=device) < self.drop_rate
            texts = ["" if d else text for text, d in zip(texts, dropped.tolist())]
        return self.encode(texts)

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]:
        """The guidance's unconditional side: the negative prompts, "" where there is none
        (diffusers' FluxPipeline with true_cfg_scale)."""
        n = len(batch[CAPTION_KEY])
        negative = [""] * n if negative is None else [text or "" for text in negative]
        return self.encode(negative)


def _encoders_from_folders(conditioner: FluxConditioner, incompatible) -> None:
    encoders_from_folders(conditioner, incompatible, ENCODERS)  # both required
