"""Image grids for the image logger and txt2img (numpy + PIL only; no torchvision)."""

import math

import numpy as np
import torch


def make_grid(
    images: torch.Tensor, nrow: int = 8, padding: int = 2, pad_value: int = 0
) -> np.ndarray:
    """Tile images (N, 3, H, W) in [-1, 1] into one uint8 picture (rows*(H+p)+p, cols*(W+p)+p, 3).

    `nrow` images per row, `padding` pixels of `pad_value` around each - torchvision's layout.
    """
    if images.dim() != 4:
        raise ValueError(f"make_grid expects (N, C, H, W), got shape {tuple(images.shape)}")
    n, channels, h, w = images.shape
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    if channels == 1:
        pixels = pixels.expand(n, 3, h, w)
    cols = min(nrow, n)
    rows = math.ceil(n / cols)
    grid = np.full(
        (rows * (h + padding) + padding, cols * (w + padding) + padding, 3), pad_value, np.uint8
    )
    for i, image in enumerate(pixels.permute(0, 2, 3, 1).numpy()):  # (H, W, 3)
        top = (i // cols) * (h + padding) + padding
        left = (i % cols) * (w + padding) + padding
        grid[top : top + h, left : left + w] = image[..., :3]
    return grid
