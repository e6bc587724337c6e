"""Image decoding and the resize-crop-flip-to-tensor transform, touching each pixel few times.

Speed comes from two things (see scripts/benchmark_data.py): JPEG draft mode lets libjpeg decode
straight to 1/2, 1/4 or 1/8 scale through its DCT when the source is much larger than the target,
and the crop is folded into the resize (`Image.resize(box=...)`), so no full-size intermediate
image is ever converted, cropped or copied.
"""

import math
import random
from typing import IO

import numpy as np
import torch
from PIL import Image

from ldm.config_errors import is_count

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INTERPOLATIONS = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
CROPS = ("center", "random")
# Pillow's own decompression-bomb threshold (~89 Mpx); larger images are refused with a message.
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS
# Downscales by more than this factor first reduce by an integer box filter, then resample; the
# result is visually identical to a direct resample at a fraction of the cost (Pillow docs).
REDUCING_GAP = 3.0
# EXIF orientation tag value -> the transpose that makes the image upright (EXIF 2.32, tag 0x0112).
_ORIENTATION_TAG = 0x0112
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SIXTEEN_BIT_GRAY = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")


class ImageError(ValueError):
    """An image that cannot be used for training: `reason` is a short category for summaries,
    `detail` the specifics for the one log line about this file."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason, self.detail = reason, detail


def _orientation(image: Image.Image) -> int:
    # Only look when the header carried EXIF: `getexif()` on a PNG without it decodes all pixels.
    if "exif" not in image.info:
        return 1
    return image.getexif().get(_ORIENTATION_TAG, 1)


def _open(source: str | IO[bytes], max_pixels: int) -> Image.Image:
    # A limit raised by the user must not be refused first by Pillow's own (process-wide) one.
    if max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        image = Image.open(source)
    except Image.DecompressionBombError as err:
        raise ImageError("decompression bomb", str(err)) from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError("not a readable image", str(err)) from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageError(
            "decompression bomb",
            f"{width}x{height} = {width * height / 1e6:.0f} Mpx is above the limit of "
            f"{max_pixels / 1e6:.0f} Mpx; raise max_image_pixels if the file is genuine",
        )
    return image


def image_size(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) as displayed (EXIF rotation applied), from the header only."""
    with _open(path, max_pixels) as image:
        width, height = image.size
        return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB; transparency composited on white, 16-bit scaled (not clipped) to 8 bits."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode in _SIXTEEN_BIT_GRAY:
        gray = (np.asarray(image, dtype=np.float32) / 257.0).clip(0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, ...


def decode_image(
    source: str | IO[bytes],
    cover: tuple[int, int] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Image.Image:
    """Decode an image file (path or binary file object) to an upright 8-bit RGB image.

    cover: (width, height) the image will be resized to cover; a JPEG much larger than that is
        decoded at a reduced scale that still covers it (draft mode), which is the main speed-up.
    Raises ImageError for anything unusable (not an image, truncated, too large).
    """
    image = _open(source, max_pixels)
    try:
        orientation = _orientation(image)
        if cover is not None and image.format == "JPEG":
            width, height = image.size
            upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
            scale = max(cover[0] / upright[0], cover[1] / upright[1])
            image.draft(None, (math.ceil(width * scale), math.ceil(height * scale)))
        image.load()
        if orientation == 1 and image.format == "PNG":
            # An eXIf chunk after the pixel data (allowed before PNG 3) is read only by `load`.
            orientation = _orientation(image)
        if orientation in _UPRIGHT:
            image = image.transpose(_UPRIGHT[orientation])
        return to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        image.close()
        raise ImageError("cannot decode", str(err)) from None


def resize_crop(
    image: Image.Image,
    size: tuple[int, int],
    interpolation: str = "bicubic",
    crop: str = "center",
    flip_p: float = 0.0,
    rng: random.Random | None = None,
) -> Image.Image:
    """Resize to cover `size` (width, height) keeping the aspect ratio, crop to it, maybe flip.

    The crop box is passed to the resize, so only the pixels that survive are resampled.
    """
    return resize_crop_geometry(image, size, interpolation, crop, flip_p, rng)[0]


def resize_crop_geometry(
    image: Image.Image,
    size: tuple[int, int],
    interpolation: str = "bicubic",
    crop: str = "center",
    flip_p: float = 0.0,
    rng: random.Random | None = None,
) -> tuple[Image.Image, dict]:
    """`resize_crop`, and where the result came from - SDXL's micro-conditioning (Podell et al.
    2023, sec. 2.2): `original_size_as_tuple` (height, width) of the image before resizing,
    `crop_coords_top_left` (top, left) of the crop in the resized image (of the mirrored image
    when flipped, so that it still says where the crop sits), `target_size_as_tuple` (H, W)."""
    rng = rng or random
    width, height = image.size
    target_w, target_h = size
    scale = max(target_w / width, target_h / height)
    box_w, box_h = target_w / scale, target_h / scale  # the source region with the target's aspect
    if crop == "random":
        left, top = rng.uniform(0, width - box_w), rng.uniform(0, height - box_h)
    else:
        left, top = (width - box_w) / 2, (height - box_h) / 2
    image = image.resize(
        size,
        INTERPOLATIONS[interpolation],
        box=(left, top, left + box_w, top + box_h),
        reducing_gap=REDUCING_GAP,
    )
    crop_left = round(left * scale)
    if flip_p > 0 and rng.random() < flip_p:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        crop_left = round(width * scale) - crop_left - target_w
    geometry = {
        "original_size_as_tuple": torch.tensor([height, width]),
        "crop_coords_top_left": torch.tensor([round(top * scale), crop_left]),
        "target_size_as_tuple": torch.tensor([target_h, target_w]),
    }
    return image, geometry


def to_tensor(image: Image.Image) -> torch.Tensor:
    """8-bit RGB image -> float32 (3, H, W) in [-1, 1].

    One pass reads the pixels channels-first and scales them into the output, one subtracts; no
    uint8 copy, no intermediate float tensor.
    """
    pixels = np.asarray(image)  # (H, W, 3) uint8, a read-only view
    out = np.empty((3, image.height, image.width), dtype=np.float32)
    np.multiply(pixels.transpose(2, 0, 1), np.float32(2 / 255), out=out, casting="unsafe")
    out -= 1.0
    return torch.from_numpy(out)


def load_image_sample(
    source: str | IO[bytes],
    size: tuple[int, int],
    interpolation: str = "bicubic",
    crop: str = "center",
    flip_p: float = 0.0,
    rng: random.Random | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> dict:
    """decode -> resize to cover `size` (width, height) -> crop -> flip: `{"image": (3, H, W) in
    [-1, 1]}` and its size / crop geometry (`resize_crop_geometry`), which SDXL's size
    conditioning reads."""
    image = decode_image(source, cover=size, max_pixels=max_pixels)
    image, geometry = resize_crop_geometry(image, size, interpolation, crop, flip_p, rng)
    return {"image": to_tensor(image), **geometry}


def load_image_tensor(*args, **kwargs) -> torch.Tensor:
    """`load_image_sample`'s image alone, for datasets without size conditioning."""
    return load_image_sample(*args, **kwargs)["image"]


def check_choice(name: str, value: str, choices) -> str:
    """Validate a config string against its allowed values with a message naming the key."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")
    return value


def check_max_pixels(value) -> int:
    """`max_image_pixels`: the decompression-bomb limit, a whole number of pixels >= 1."""
    if not is_count(value, 1):
        raise ValueError(
            f"max_image_pixels={value!r}: expected a whole number of pixels >= 1 "
            f"(default {DEFAULT_MAX_PIXELS})"
        )
    return value
