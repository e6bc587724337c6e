"""Does a model trained on scripts/make_shapes.py data draw the colour and shape it is asked for?

    python scripts/eval_shapes.py --ckpt logs/<run>/checkpoints/last.ckpt --n 8

Generates `--n` images for every (colour, shape) prompt ("a red circle", ...) and reads colour
and shape back with a deterministic pixel analysis - no learned classifier whose own mistakes
would blur the score. On the training images themselves it is right every time:

1. background = the most common colour of the one-pixel frame (a shape covers less of it);
2. foreground = the largest 4-connected blob of pixels far from the background colour;
3. colour = the palette colour nearest to the blob's median colour;
4. per-pixel coverage = how far a pixel lies from the background towards the blob colour (0..1),
   which measures anti-aliased edges to a fraction of a pixel;
5. shape: a triangle (apex up, as drawn) has its area low down - over its rows, the area
   between the quantiles 0.5 and 0.9 spans 0.24 of its height, that between 0.1 and 0.5 spans
   0.39: a ratio of 0.62, where shapes symmetric top to bottom give 1. Else the fill ratio
   area / (height x width), with height the largest column sum and width the largest row sum,
   tells a square (1) from a circle (pi/4 = 0.79).

Prints colour accuracy, shape accuracy and the share of images with both right. A
class-conditional model (trained on `make_shapes.py --layout classes`, e.g.
configs/dit/shapes-dit.yaml) is asked for each colour-shape class instead of a prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


import argparse
import sys
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shapes import SHAPE_COLORS, SHAPES, article, class_names  # noqa: E402

# A pixel belongs to the foreground when it is this far (RGB distance, 0-255 scale) from the
# background: 3x the spread of the textured backgrounds' noise (std 12 per channel -> ~21 in
# RGB), and well under the closest shape/background pair (purple on gray, 103).
FOREGROUND_DISTANCE = 60.0
MIN_AREA_FRACTION = 0.02  # a blob smaller than this share of the image is no shape
# Boundaries halfway between the ideal shapes: upper / lower spread of the area 0.62 (triangle)
# vs 1 (circle, square); fill ratio pi/4 (circle) vs 1 (square).
TRIANGLE_SPREAD_BELOW = 0.81
SQUARE_FILL_ABOVE = 0.89
PALETTE = np.array(list(SHAPE_COLORS.values()), dtype=np.float32)  # (K, 3)


@dataclass(frozen=True)
class Reading:
    """What the pixel analysis sees in one image (None: no foreground blob found)."""

    color: str | None
    shape: str | None
    fill: float = 0.0
    spread: float = 0.0


def largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean (H, W) mask, as a mask."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    height, width = mask.shape
    for y, x in zip(*np.nonzero(mask)):
        if labels[y, x]:
            continue
        label += 1
        labels[y, x] = label
        queue, size = deque([(y, x)]), 0
        while queue:
            cy, cx = queue.popleft()
            size += 1
            for ny, nx in ((cy - 1, cx), (cy + 1, cx), (cy, cx - 1), (cy, cx + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_label else np.zeros_like(mask)


def dilate(mask: np.ndarray) -> np.ndarray:
    """Grow a boolean mask by one pixel (4-neighbourhood)."""
    grown = mask.copy()
    grown[1:] |= mask[:-1]
    grown[:-1] |= mask[1:]
    grown[:, 1:] |= mask[:, :-1]
    grown[:, :-1] |= mask[:, 1:]
    return grown


def vertical_spread_ratio(row_area: np.ndarray) -> float:
    """(q90 - q50) / (q50 - q10) of the area's distribution over rows (each row's area spread
    evenly over its pixel height): 1 for shapes symmetric top to bottom, 0.62 for a triangle."""
    cumulative = np.concatenate([[0.0], np.cumsum(row_area)]) / row_area.sum()  # (H + 1,)
    q10, q50, q90 = np.interp([0.1, 0.5, 0.9], cumulative, np.arange(len(cumulative)))
    return float((q90 - q50) / max(q50 - q10, 1e-6))


def background_color(pixels: np.ndarray) -> np.ndarray:
    """The most common colour of the one-pixel frame (H, W, 3) -> (3,): the median of the largest
    group of frame pixels within FOREGROUND_DISTANCE of one another's centre, so a shape touching
    two sides (up to ~45 % of the frame) does not shift it."""
    frame = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])  # (F, 3)
    near = np.linalg.norm(frame[:, None] - frame[None], axis=-1) < FOREGROUND_DISTANCE  # (F, F)
    return np.median(frame[near[near.sum(axis=1).argmax()]], axis=0)


def classify(fill: float, spread: float) -> str:
    if spread < TRIANGLE_SPREAD_BELOW:
        return "triangle"
    return "square" if fill > SQUARE_FILL_ABOVE else "circle"


def analyze(image: np.ndarray) -> Reading:
    """Colour and shape of the one shape in an RGB image (H, W, 3), uint8 or float 0..255."""
    pixels = np.asarray(image, dtype=np.float32)[..., :3]  # (H, W, 3)
    background = background_color(pixels)
    distance = np.linalg.norm(pixels - background, axis=-1)  # (H, W)
    blob = largest_blob(distance > FOREGROUND_DISTANCE)
    if blob.sum() < MIN_AREA_FRACTION * blob.size:
        return Reading(None, None)
    foreground = np.median(pixels[blob], axis=0)  # (3,)
    color = list(SHAPE_COLORS)[int(np.argmin(np.linalg.norm(PALETTE - foreground, axis=-1)))]

    # Coverage: the projection of (pixel - background) onto (foreground - background), so an
    # edge pixel half covered by the shape counts one half. Only the blob and its rim count,
    # so background texture elsewhere adds nothing.
    direction = foreground - background
    coverage = ((pixels - background) @ direction) / float(direction @ direction)
    coverage = np.clip(coverage, 0.0, 1.0) * dilate(blob)  # (H, W)
    height, width = coverage.sum(axis=0).max(), coverage.sum(axis=1).max()
    fill = float(coverage.sum() / max(height * width, 1e-6))
    spread = vertical_spread_ratio(coverage.sum(axis=1))
    return Reading(color, classify(fill, spread), fill, spread)


@dataclass
class Scores:
    """Counts of right colours and shapes over the scored images."""

    total: int = 0
    color: int = 0
    shape: int = 0
    both: int = 0

    def add(self, reading: Reading, color: str, shape: str) -> None:
        self.total += 1
        self.color += reading.color == color
        self.shape += reading.shape == shape
        self.both += reading.color == color and reading.shape == shape

    def percent(self, count: int) -> float:
        return 100.0 * count / max(self.total, 1)

    def summary(self) -> str:
        return (
            f"colour accuracy {self.percent(self.color):.1f} %, "
            f"shape accuracy {self.percent(self.shape):.1f} %, "
            f"both {self.percent(self.both):.1f} % ({self.total} images)"
        )


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) uint8, as the PNGs txt2img writes."""
    array = ((images.float().clamp(-1, 1) + 1) * 127.5).round().byte()
    return array.permute(0, 2, 3, 1).cpu().numpy()


def prompts_to_score(template: str) -> list[tuple[str, str, str]]:
    """(prompt, colour, shape) for every colour and shape."""
    return [
        (template.format(a=article(color), color=color, shape=shape), color, shape)
        for color in SHAPE_COLORS
        for shape in SHAPES
    ]


def evaluate(model, args) -> tuple[Scores, torch.Tensor, list[str]]:
    """Sample `args.n` images per prompt (image i from seed args.seed + i) and score them.

    Returns the scores, the images (prompt-major) and one line per prompt of what was seen."""
    import torch

    from lun.generation import starting_noise

    size = args.size or model.default_image_size
    latent_shape = model.latent_shape(size, size)
    noise = starting_noise(list(range(args.seed, args.seed + args.n)), latent_shape, model.device)
    prompts = prompts_to_score(args.template)
    if model.class_count is not None:  # class-conditional (DiT on --layout classes)
        prompts = [(class_names().index(f"{c}-{s}"), c, s) for _, c, s in prompts]
    per_batch = max(1, args.batch_size // args.n)  # prompts per sampling batch
    images = []
    for first in range(0, len(prompts), per_batch):
        batch = [prompt for prompt, _, _ in prompts[first : first + per_batch]]
        with torch.no_grad():
            images.append(
                model.sample(
                    [prompt for prompt in batch for _ in range(args.n)],
                    height=size,
                    width=size,
                    sampler=args.sampler,
                    steps=args.steps,
                    scale=args.scale,
                    noise=noise.repeat(len(batch), 1, 1, 1),
                    generator=torch.Generator(model.device).manual_seed(args.seed),
                ).cpu()
            )
    images = torch.cat(images)  # (len(prompts) * n, 3, H, W)
    readings = [analyze(image) for image in to_uint8(images)]
    scores, lines = Scores(), []
    for i, (prompt, color, shape) in enumerate(prompts):
        seen = readings[i * args.n : (i + 1) * args.n]
        for reading in seen:
            scores.add(reading, color, shape)
        counts = Counter(f"{r.color} {r.shape}" if r.color else "no shape" for r in seen)
        counts = counts.most_common(3)
        name = prompt if isinstance(prompt, str) else f"class {prompt} ({color} {shape})"
        lines.append(f"  {name:28s} seen: " + ", ".join(f"{k} x{v}" for k, v in counts))
    return scores, images, lines


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint of a run trained on shapes")
    parser.add_argument("--config", help="model config (default: the run folder's saved config)")
    parser.add_argument("--n", type=int, default=8, help="images per (colour, shape) prompt")
    parser.add_argument(
        "--template", default="{a} {color} {shape}", help="prompt ({a}: 'a' or 'an')"
    )
    parser.add_argument("--sampler", default="ddim")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--scale", type=float, default=4.0, help="classifier-free guidance scale")
    parser.add_argument("--size", type=int, default=None, help="image side (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="image i of each prompt uses seed + i")
    parser.add_argument("--batch-size", type=int, default=72, help="images per sampling batch")
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use EMA weights (default: when the checkpoint has them)",
    )
    parser.add_argument("--grid", help="also save every scored image as one grid PNG here")
    parser.add_argument("--verbose", action="store_true", help="what was seen for each prompt")
    args = parser.parse_args(argv)

    from PIL import Image

    from lun.cli import check_output_file
    from lun.generation import load_model, one_line_errors, save_png
    from lun.images import make_grid

    with one_line_errors():  # a wrong file: one line naming it, exit 2, before any sampling
        if args.grid:
            check_output_file(args.grid, "--grid", (".png",))
        model = load_model(
            argparse.Namespace(
                ckpt=args.ckpt, config=args.config, ema=args.ema, unsafe_load=False, device="cpu"
            )
        )
        scores, images, lines = evaluate(model, args)
        if args.verbose:
            print("\n".join(lines))
        if args.grid:
            save_png(Image.fromarray(make_grid(images, nrow=args.n)), Path(args.grid))
            print(f"scored images: {args.grid} (one row per prompt)")
    print(scores.summary())


if __name__ == "__main__":
    main()
