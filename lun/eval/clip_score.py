"""CLIP score: how well images agree with their prompts (Hessel et al. 2021, "CLIPScore: A
Reference-free Evaluation Metric for Image Captioning", arXiv:2104.08718).

Per image 100 * max(cos(E_image, E_text), 0) with CLIP's projected embeddings, averaged (the
scaling of torchmetrics' CLIPScore; the paper's w = 2.5 instead of 100 only rescales). The model
is a local Hugging Face `CLIPModel` folder (e.g. a copy of openai/clip-vit-large-patch14 made on
a machine with network access); nothing is downloaded.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# OpenAI CLIP's image normalization (used when the folder has no preprocessor_config.json).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def check_clip_folder(path, key: str = "clip") -> None:
    if path is None or not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{key}={path}: no CLIP model folder (config.json + weights); save one with "
            "transformers' CLIPModel.from_pretrained('openai/clip-vit-large-patch14')"
            ".save_pretrained(DIR) (and CLIPTokenizer likewise) where the network is reachable"
        )


class CLIPScorer(nn.Module):
    """CLIP score of images against their prompts with a local CLIP folder.

    The tokenizer comes from the folder when it holds one, else the offline CLIP BPE tokenizer
    (ldm.text_encoder.clip_tokenizer, the same ids as OpenAI CLIP's).
    """

    def __init__(self, folder: str | Path):
        super().__init__()
        from transformers import CLIPModel

        from ldm.text_encoder import clip_tokenizer

        check_clip_folder(folder)
        folder = Path(folder)
        self.model = CLIPModel.from_pretrained(folder, local_files_only=True)
        self.model.eval().requires_grad_(False)
        has_vocab = (folder / "vocab.json").is_file()
        self.tokenizer = clip_tokenizer(str(folder) if has_vocab else None)
        self.image_size = self.model.config.vision_config.image_size
        mean, std = CLIP_MEAN, CLIP_STD
        preprocessor = folder / "preprocessor_config.json"
        if preprocessor.is_file():
            config = json.loads(preprocessor.read_text())
            mean, std = config.get("image_mean", mean), config.get("image_std", std)
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> CLIP's input: shorter side resized to the model's size
        (bicubic, as CLIPImageProcessor), centre crop, normalized."""
        x = (images.float().clamp(-1, 1) + 1) / 2
        height, width = x.shape[-2:]
        scale = self.image_size / min(height, width)
        size = (
            max(self.image_size, round(height * scale)),
            max(self.image_size, round(width * scale)),
        )
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
        top, left = (size[0] - self.image_size) // 2, (size[1] - self.image_size) // 2
        x = x[..., top : top + self.image_size, left : left + self.image_size].clamp(0, 1)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Per-image scores (B,): 100 * max(cos, 0)."""
        max_length = self.model.config.text_config.max_position_embeddings
        tokens = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        ).to(images.device)
        image_embeds = self.model.get_image_features(pixel_values=self.preprocess(images))
        text_embeds = self.model.get_text_features(**tokens)
        image_embeds = getattr(image_embeds, "pooler_output", image_embeds)
        text_embeds = getattr(text_embeds, "pooler_output", text_embeds)
        cos = F.cosine_similarity(image_embeds.float(), text_embeds.float(), dim=-1)
        return 100 * cos.clamp(min=0)
