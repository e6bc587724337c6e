"""Helpers of the evaluation tests (imported by name): a tiny CLIP folder, a SmallCNN file."""

from pathlib import Path

import torch
from safetensors.torch import save_file


def make_clip_folder(folder: Path, image_size: int = 16) -> Path:
    """A tiny random CLIPModel saved with transformers, with the offline CLIP tokenizer."""
    from transformers import CLIPConfig, CLIPModel

    from ldm.text_encoder import clip_tokenizer

    torch.manual_seed(0)
    tower = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(
        text_config=tower,
        vision_config={**tower, "image_size": image_size, "patch_size": 8},
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(folder)
    clip_tokenizer().save_pretrained(folder)
    return folder


def make_small_features(path: Path, size: int, seed: int = 0) -> Path:
    """A random SmallCNN feature-extractor file (16-d features)."""
    from lun.eval.features import SmallCNN

    torch.manual_seed(seed)
    net = SmallCNN(num_classes=4, widths=(8, 16), size=size)
    save_file(net.state_dict(), str(path), metadata=net.metadata())
    return path
