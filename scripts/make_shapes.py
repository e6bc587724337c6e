"""Make a synthetic captioned image set: coloured shapes on plain or textured backgrounds.

    python scripts/make_shapes.py --out data/shapes --n 2000 --size 32 --seed 0

Writes the flat-file layout of `lun.data.local.Local`: `images/NNNNN.png` and
`captions/NNNNN.txt` ("a red circle on a white background", with some wording variety).
"""

import argparse
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPE_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 180),
    "orange": (245, 140, 30),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
TEMPLATES = (
    "a {color} {shape} on a {background} background",
    "a {color} {shape}",
    "{color} {shape}, {background} background",
    "a picture of a {color} {shape} on {background}",
)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # triangle pointing up
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def make_image(rng: random.Random, size: int, color: str, shape: str, background: str,
               textured: bool) -> Image.Image:
    base = np.full((size, size, 3), BACKGROUNDS[background], dtype=np.float32)
    if textured:  # low-contrast noise, so the model must ignore texture to find the shape
        base += np.random.default_rng(rng.randrange(2**32)).normal(0, 12, base.shape)
    image = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    # Shapes cover 35-70 % of the side, anywhere fully inside the image.
    side = rng.uniform(0.35, 0.7) * size
    x0, y0 = rng.uniform(0, size - side), rng.uniform(0, size - side)
    draw_shape(ImageDraw.Draw(image), shape, (x0, y0, x0 + side, y0 + side), SHAPE_COLORS[color])
    return image


def make_caption(rng: random.Random, color: str, shape: str, background: str) -> str:
    return rng.choice(TEMPLATES).format(color=color, shape=shape, background=background)


def make_shapes(out: Path, n: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "captions").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        color, shape = rng.choice(list(SHAPE_COLORS)), rng.choice(SHAPES)
        background, textured = rng.choice(list(BACKGROUNDS)), rng.random() < 0.3
        make_image(rng, size, color, shape, background, textured).save(out / "images" / f"{i:05d}.png")
        (out / "captions" / f"{i:05d}.txt").write_text(make_caption(rng, color, shape, background))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/shapes", help="output folder")
    parser.add_argument("--n", type=int, default=2000, help="number of images")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_shapes(Path(args.out), args.n, args.size, args.seed)
    print(f"wrote {args.n} images to {args.out}")


if __name__ == "__main__":
    main()
