"""Decoding every kind of image users bring, and the resize-crop-flip-tensor transform."""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from lun.data.images import (
    ImageError,
    check_choice,
    decode_image,
    image_size,
    load_image_tensor,
    resize_crop,
    to_tensor,
)


def test_truncated_jpeg_zero_bytes_and_text_named_jpg_are_image_errors(tmp_path, writers):
    data = writers.jpeg_bytes((64, 64))
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "zero.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("this is not an image")
    for name, reason in [
        ("truncated.jpg", "cannot decode"),
        ("zero.jpg", "not a readable image"),
        ("text.jpg", "not a readable image"),
    ]:
        with pytest.raises(ImageError) as info:
            decode_image(str(tmp_path / name))
        assert info.value.reason == reason, name


def test_cmyk_becomes_rgb(tmp_path, writers):
    path = writers.save(tmp_path / "cmyk.jpg", mode="CMYK", color=(0, 255, 255, 0), quality=95)
    assert Image.open(path).mode == "CMYK"
    image = decode_image(str(path))
    assert image.mode == "RGB"
    red, green, blue = np.asarray(image, dtype=float).mean(axis=(0, 1))
    assert red > 200 and green < 60 and blue < 60


def test_sixteen_bit_grayscale_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 32896, 65535]], dtype=np.uint16)  # 32896 = 128 * 257
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith("I")
    image = decode_image(str(path))
    assert image.mode == "RGB"
    assert np.asarray(image)[0, :, 0].tolist() == [0, 128, 255]


def test_transparency_is_composited_on_white(tmp_path):
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)  # index 0 black (transparent), 1 red
    palette.putpixel((0, 0), 1)
    palette.save(tmp_path / "palette.png", transparency=0)
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 255, 0, 255))
    rgba.save(tmp_path / "rgba.png")
    Image.new("LA", (4, 4), (0, 0)).save(tmp_path / "la.png")
    for name, opaque in [("palette.png", (255, 0, 0)), ("rgba.png", (0, 255, 0)), ("la.png", None)]:
        pixels = np.asarray(decode_image(str(tmp_path / name)))
        assert pixels[3, 3].tolist() == [255, 255, 255], name  # transparent -> white
        if opaque:
            assert pixels[0, 0].tolist() == list(opaque), name


def test_grayscale_and_bw_become_rgb(tmp_path, writers):
    writers.save(tmp_path / "gray.png", mode="L", color=77)
    writers.save(tmp_path / "bw.bmp", mode="1", color=1)
    assert np.asarray(decode_image(str(tmp_path / "gray.png")))[0, 0].tolist() == [77, 77, 77]
    assert np.asarray(decode_image(str(tmp_path / "bw.bmp")))[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(tmp_path, writers, orientation):
    path = writers.exif_rotated(tmp_path / "rotated.jpg", orientation)
    reference = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    image = decode_image(str(path))
    assert image.size == reference.size == ((20, 40) if orientation in (6, 8) else (40, 20))
    assert np.array_equal(np.asarray(image), np.asarray(reference))
    assert image_size(str(path)) == reference.size  # header-only size agrees


def test_decompression_bomb_is_refused_with_a_clear_message(tmp_path, writers):
    (tmp_path / "bomb.png").write_bytes(writers.bomb_png(60000, 60000))
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(str(tmp_path / "bomb.png"))
    with pytest.raises(ImageError, match="decompression bomb"):
        image_size(str(tmp_path / "bomb.png"))
    small = writers.save(tmp_path / "small.png", size=(64, 64))
    with pytest.raises(ImageError, match="max_image_pixels"):
        decode_image(str(small), max_pixels=32 * 32)


def test_jpeg_draft_decodes_large_sources_at_reduced_scale(tmp_path, writers):
    path = writers.save(tmp_path / "big.jpg", color=writers.noise((1024, 768)))
    assert decode_image(str(path)).size == (1024, 768)
    # Covering 256 x 256 needs 342 x 256: libjpeg's 1/2 scale (512 x 384) is the smallest that does.
    assert decode_image(str(path), cover=(256, 256)).size == (512, 384)
    tensor = load_image_tensor(str(path), (256, 256))
    assert tensor.shape == (3, 256, 256)
    # Bytes work as well as paths (WebDataset / Parquet).
    assert decode_image(io.BytesIO(path.read_bytes()), cover=(64, 64)).size == (128, 96)


def test_resize_crop_covers_the_target_and_crops():
    image = Image.new("RGB", (200, 100), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 50, 100))  # white left quarter
    center = resize_crop(image, (64, 64), "bilinear", "center")
    assert center.size == (64, 64)
    assert np.asarray(center)[:, :4].mean() < 10  # the white quarter was cropped away
    flipped = resize_crop(image, (64, 64), "bilinear", "center", flip_p=1.0)
    assert np.array_equal(np.asarray(flipped), np.asarray(center)[:, ::-1])
    lefts = {
        float(
            np.asarray(resize_crop(image, (64, 64), "lanczos", "random", rng=random.Random(s)))[
                :, 0
            ].mean()
        )
        for s in range(8)
    }
    assert len(lefts) > 1 and max(lefts) > 200  # random windows differ, some include the white edge


def test_to_tensor_layout_and_range():
    image = Image.new("RGB", (5, 3), (0, 255, 0))
    tensor = to_tensor(image)
    assert tensor.dtype == torch.float32 and tensor.shape == (3, 3, 5) and tensor.is_contiguous()
    assert tensor[0].eq(-1).all() and tensor[1].eq(1).all() and tensor[2].eq(-1).all()


def test_check_choice_names_the_key():
    assert check_choice("crop", "random", ("center", "random")) == "random"
    with pytest.raises(ValueError, match="interpolation='nearest'"):
        check_choice("interpolation", "nearest", ("bilinear", "bicubic", "lanczos"))
