"""Make a synthetic captioned image set: coloured shapes on plain or textured backgrounds.

    python scripts/make_shapes.py --out data/shapes --n 2000 --size 32 --seed 0

Writes the flat-file layout of `lun.data.local.Local`: `images/NNNNN.png` and
`captions/NNNNN.txt` ("a red circle on a blue background", with some wording variety); with
`--layout classes`, the class-folder layout of `lun.data.class_folder.ClassFolder` instead:
`<colour>-<shape>/NNNNN.png`, 18 classes (for class-conditional models such as DiT).
One shape per image, axis-aligned, 50-85 % of the image side, anywhere fully inside it.
Shapes are drawn at 4x the size and box-filtered down, so small images get smooth edges
rather than staircases. `scripts/eval_shapes.py` reads colour and shape back from pixels.
"""

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# Hues far apart in RGB, so that a colour is named by its nearest palette entry.
SHAPE_COLORS = {
    "red": (215, 30, 30),
    "orange": (250, 140, 0),
    "yellow": (240, 220, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "purple": (140, 40, 180),
}
# Neutral backgrounds: a colour word in a caption then always names the shape's colour, which a
# small text encoder trained for minutes learns much faster than "blue" in two roles.
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
TEMPLATES = (
    "{a} {color} {shape} on a {background} background",
    "{a} {color} {shape}",
    "{color} {shape}, {background} background",
    "a picture of {a} {color} {shape} on {background}",
    "an image of {a} {color} {shape}",
)
TEXTURED_FRACTION = 0.3
TEXTURE_STD = 12.0  # per channel, 0-255 scale: visible, but far below any colour difference
SUPERSAMPLING = 4


@dataclass(frozen=True)
class ShapeImage:
    """What one generated image shows (the ground truth of `scripts/eval_shapes.py`)."""

    name: str
    color: str
    shape: str
    background: str
    textured: bool
    caption: str


def draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill
) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # triangle pointing up, base at the bottom
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def make_image(
    rng: random.Random, size: int, color: str, shape: str, background: str, textured: bool
) -> Image.Image:
    big = size * SUPERSAMPLING
    image = Image.new("RGB", (big, big), BACKGROUNDS[background])
    side = rng.uniform(0.5, 0.85) * big
    x0, y0 = rng.uniform(0, big - side), rng.uniform(0, big - side)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    draw_shape(ImageDraw.Draw(image), shape, box, SHAPE_COLORS[color])
    pixels = np.asarray(image.resize((size, size), Image.Resampling.BOX), dtype=np.float32)
    if textured:  # low-contrast noise on the background, so the model must look past texture
        noise = np.random.default_rng(rng.randrange(2**32)).normal(0, TEXTURE_STD, pixels.shape)
        on_background = np.all(pixels == BACKGROUNDS[background], axis=-1, keepdims=True)
        pixels = pixels + noise * on_background
    return Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8))


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def make_caption(
    rng: random.Random, color: str, shape: str, background: str, textured: bool
) -> str:
    if textured:
        background = f"textured {background}"
    template = rng.choice(TEMPLATES)
    return template.format(a=article(color), color=color, shape=shape, background=background)


def class_names() -> list[str]:
    """The 18 class folders of `--layout classes`, in class-id order (sorted, as ClassFolder)."""
    return sorted(f"{color}-{shape}" for color in SHAPE_COLORS for shape in SHAPES)


def make_shapes(
    out: Path, n: int, size: int, seed: int, layout: str = "captions"
) -> list[ShapeImage]:
    """Write n images and captions under `out` (or n images in class folders, layout "classes");
    returns what each image shows."""
    rng = random.Random(seed)
    if layout == "classes":
        for name in class_names():
            (out / name).mkdir(parents=True, exist_ok=True)
    else:
        (out / "images").mkdir(parents=True, exist_ok=True)
        (out / "captions").mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(n):
        color, shape = rng.choice(list(SHAPE_COLORS)), rng.choice(SHAPES)
        background = rng.choice(list(BACKGROUNDS))
        textured = rng.random() < TEXTURED_FRACTION
        name = f"{i:05d}"
        image = make_image(rng, size, color, shape, background, textured)
        caption = make_caption(rng, color, shape, background, textured)
        if layout == "classes":
            image.save(out / f"{color}-{shape}" / f"{name}.png")
        else:
            image.save(out / "images" / f"{name}.png")
            (out / "captions" / f"{name}.txt").write_text(caption)
        written.append(ShapeImage(name, color, shape, background, textured, caption))
    return written


def main() -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", default="data/shapes", help="output folder")
    parser.add_argument("--n", type=int, default=2000, help="number of images")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layout",
        choices=("captions", "classes"),
        default="captions",
        help="images + captions (Local), or one folder per colour-shape class (ClassFolder)",
    )
    args = parser.parse_args()
    make_shapes(Path(args.out), args.n, args.size, args.seed, args.layout)
    print(f"wrote {args.n} images to {args.out}")


if __name__ == "__main__":
    main()
