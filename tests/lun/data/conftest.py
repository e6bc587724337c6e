"""Image and dataset writers for the lun.data tests: every file is generated here, in tmp_path."""

import io
import struct
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image


def save_image(path, size=(32, 24), color=(200, 30, 30), mode="RGB", fmt=None, **save_args):
    """Write a solid (or given) image; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = color if isinstance(color, Image.Image) else Image.new(mode, size, color)
    image.save(path, format=fmt, **save_args)
    return path


def noise_image(size, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def jpeg_bytes(size=(32, 24), seed=0) -> bytes:
    buffer = io.BytesIO()
    noise_image(size, seed).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def png_with_claimed_size(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (a decompression bomb's header)."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    ihdr = 8  # after the signature: length(4) type(4) data(13) crc(4)
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4 : ihdr + 21])) & 0xFFFFFFFF
    data[ihdr + 21 : ihdr + 25] = struct.pack(">I", crc)
    return bytes(data)


def exif_rotated_jpeg(path, orientation=6):
    """Left half red, right half blue, stored sideways with an EXIF orientation tag."""
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return save_image(path, color=image, exif=exif.tobytes())


def write_shard(path, samples):
    """samples: [(key, {ext: bytes | str})] -> a tar in WebDataset layout; returns the path."""
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for ext, data in files.items():
                data = data.encode() if isinstance(data, str) else data
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def writers():
    """The writer functions, for tests that build their own folders."""

    class Writers:
        save = staticmethod(save_image)
        noise = staticmethod(noise_image)
        jpeg_bytes = staticmethod(jpeg_bytes)
        bomb_png = staticmethod(png_with_claimed_size)
        exif_rotated = staticmethod(exif_rotated_jpeg)
        shard = staticmethod(write_shard)

    return Writers


@pytest.fixture
def flat_folder(tmp_path):
    """data_root with 6 captioned images in nested folders (captions/ and beside-the-image)."""
    root = tmp_path / "flat"
    for i in range(6):
        sub = "a" if i < 3 else "b/c"
        save_image(
            root / "images" / sub / f"{i}.png", size=(32 + 8 * i, 24), color=(40 * i, 10, 10)
        )
        caption = root / ("captions" if i % 2 else "images") / sub / f"{i}.txt"
        caption.parent.mkdir(parents=True, exist_ok=True)
        caption.write_text(f"caption {i}")
    return root
