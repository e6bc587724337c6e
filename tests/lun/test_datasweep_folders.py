"""A user's real, messy folder: every kind of image and caption file people have, and the sets
that go wrong (empty, all filtered, smaller than a batch). Each file is written here (PIL, or
bytes for the broken ones); each case is either read correctly, or skipped and counted with its
name in the log, or refused in one line - never silently wrong (docs/data-sources.md)."""

import codecs
import io
import logging
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from lun.data.class_folder import ClassFolder
from lun.data.datamodule import DataModule
from lun.data.dataset_report import main as inspect_data
from lun.data.images import ImageError, decode_image, image_size, load_image_tensor
from lun.data.local import Local

RED, BLUE = (255, 0, 0), (0, 0, 255)
LONG = " ".join(["word"] * 200)  # far over CLIP's 77 tokens: kept whole, the encoder truncates


def _save(path, image, fmt=None, **args):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt, **args)
    return path


def _red_left_blue_right(size=(16, 8)) -> Image.Image:
    image = Image.new("RGB", size, RED)
    image.paste(BLUE, (size[0] // 2, 0, size[0], size[1]))
    return image


def _sideways(path, fmt):
    """Stored 16x8 (red left, blue right) with EXIF orientation 6: shown 8x16, red on top."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(path, _red_left_blue_right(), fmt, exif=exif.tobytes())


def _late_exif_png(path):
    """A sideways PNG whose eXIf chunk comes after IDAT (as older PNG tools write it)."""
    buffer = io.BytesIO()
    _red_left_blue_right().save(buffer, "PNG")
    data = buffer.getvalue()
    exif = Image.Exif()
    exif[0x0112] = 6
    body = b"eXIf" + exif.tobytes()
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    end = data.rindex(b"IEND") - 4
    path.write_bytes(data[:end] + chunk + data[end:])
    return path


def _jpeg_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 10, 10)).save(buffer, "JPEG")
    return buffer.getvalue()


def _bomb_header(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims width x height (what a decompression bomb looks like)."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def _kinds(folder) -> dict:
    """One file of each kind users have; name -> what decoding must give (mode RGB, 8-bit)."""
    rgb = Image.new("RGB", (16, 8), (200, 10, 10))
    palette = Image.new("P", (16, 8), 1)
    palette.putpalette([0, 255, 0, 0, 0, 255])
    animated = [Image.new("RGB", (16, 8), c) for c in (RED, (0, 255, 0))]
    _save(folder / "cmyk.jpg", rgb.convert("CMYK"))
    _save(folder / "gray16.png", Image.fromarray(np.full((8, 16), 40000, np.uint16)))
    _save(folder / "palette.png", palette, transparency=1)  # index 1 is see-through
    _save(folder / "la.png", Image.new("LA", (16, 8), (0, 0)))
    _save(folder / "rgba.png", Image.new("RGBA", (16, 8), (0, 0, 0, 0)))
    _save(folder / "one.png", Image.new("RGB", (1, 1), (7, 8, 9)))
    _save(folder / "anim.webp", animated[0], save_all=True, append_images=animated[1:])
    return {  # the first pixel, as the model sees it
        "cmyk.jpg": (200, 10, 10),
        "gray16.png": (155, 155, 155),  # 40000 / 257: scaled to 8 bits, not clipped to 255
        "palette.png": (255, 255, 255),  # transparency composited on white
        "la.png": (255, 255, 255),
        "rgba.png": (255, 255, 255),
        "one.png": (7, 8, 9),
        "anim.webp": RED,  # the first frame
    }


def test_every_image_kind_decodes_upright_8bit_rgb(tmp_path):
    for fmt in ("JPEG", "PNG", "WEBP"):  # EXIF orientation in each container that carries it
        path = _sideways(tmp_path / f"sideways.{fmt.lower()}", fmt)
        image = decode_image(str(path))
        assert image.size == (8, 16) and image_size(str(path)) == (8, 16), fmt
        top, bottom = image.getpixel((4, 2)), image.getpixel((4, 13))
        assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0], (fmt, top, bottom)
    late = _late_exif_png(tmp_path / "late.png")  # orientation 6 after the pixels
    assert decode_image(str(late)).size == (8, 16)
    for name, first_pixel in _kinds(tmp_path).items():
        image = decode_image(str(tmp_path / name))
        assert image.mode == "RGB", name
        assert np.abs(np.subtract(image.getpixel((0, 0)), first_pixel)).max() <= 3, name
    assert load_image_tensor(str(tmp_path / "one.png"), (8, 8)).shape == (3, 8, 8)  # 1x1 upscaled

    (tmp_path / "truncated.jpg").write_bytes(_jpeg_bytes()[:200])
    (tmp_path / "text.jpg").write_text("not an image")
    (tmp_path / "bomb.png").write_bytes(_bomb_header(20_000, 20_000))
    for name, reason in (
        ("truncated.jpg", "cannot decode|not a readable image"),
        ("text.jpg", "not a readable image"),
        ("bomb.png", "decompression bomb"),
    ):
        with pytest.raises(ImageError, match=reason):
            decode_image(str(tmp_path / name))
    with pytest.raises(ImageError, match="raise max_image_pixels"):
        decode_image(str(tmp_path / "one.png"), max_pixels=0.5)  # the user's own limit, named


def _messy_folder(root):
    """A flat folder as users have them: images of every kind, captions in every encoding, and
    what must be left out (a zero-byte file, a broken link, a name that is not UTF-8, macOS and
    hidden files)."""
    images = root / "images"
    first_pixels = _kinds(images)
    _sideways(images / "rotated.jpg", "JPEG")
    _save(images / "UPPER.JPG", Image.new("RGB", (16, 8)))
    _save(images / "upper.JPEG", Image.new("RGB", (16, 8)))
    _save(images / "UPPER.WEBP", Image.new("RGB", (16, 8)), "WEBP")
    _save(images / "café ñ 猫.png", Image.new("RGB", (16, 8)))
    (images / "truncated.jpg").write_bytes(_jpeg_bytes()[:200])
    (images / "text.jpg").write_text("not an image")
    (images / "zero.jpg").write_bytes(b"")
    (images / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (images / "._rotated.jpg").write_bytes(b"\0\5\26\7" + b"\0" * 60)  # a macOS resource fork
    (images / "gif.gif").write_bytes(b"GIF89a")  # not a training image type: not listed
    os.symlink(images / "one.png", images / "link.png")
    os.symlink(images / "gone.png", images / "dangling.png")
    with open(os.path.join(os.fsencode(images), b"caf\xe9.png"), "wb") as file:
        Image.new("RGB", (16, 8)).save(file, "PNG")  # a cp1252 name from an old zip
    captions = {
        "cmyk": b"",  # an empty file: the empty caption, as written
        "gray16": codecs.BOM_UTF8 + b"bom caption",
        "palette": b"crlf caption\r\n",
        "la": "utf16 caption".encode("utf-16"),  # with its BOM, as Notepad writes it
        "rgba": "café".encode("latin-1"),
        "one": b"(tag:1.2), [other], tag3\n",  # weights are text here, kept as written
        "rotated": LONG.encode(),
        "café ñ 猫": "unicode ✓".encode(),
    }
    for stem, data in captions.items():
        (images / f"{stem}.txt").write_bytes(data)
    (images / "UPPER.TXT").write_bytes(b"shouting")  # a Windows tool's upper-case extension
    return root, first_pixels


EXPECTED_CAPTIONS = {
    "images/cmyk.jpg": "",
    "images/gray16.png": "bom caption",
    "images/palette.png": "crlf caption",
    "images/la.png": "utf16 caption",
    "images/rgba.png": "café",
    "images/one.png": "(tag:1.2), [other], tag3",
    "images/rotated.jpg": LONG,
    "images/café ñ 猫.png": "unicode ✓",
    "images/UPPER.JPG": "shouting",
    "images/UPPER.WEBP": "shouting",  # the same stem: the same caption
}
UNCAPTIONED = ["anim.webp", "link.png", "text.jpg", "truncated.jpg"]
UNCAPTIONED += ["upper.JPEG"]


def test_a_messy_folder_is_read_counted_and_named(tmp_path, caplog):
    root, _ = _messy_folder(tmp_path / "data")
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(root), size=8, cache_dir=False)
    names = [dataset.image_name(i) for i in range(len(dataset))]
    assert sorted(names) == sorted([*EXPECTED_CAPTIONS, *(f"images/{n}" for n in UNCAPTIONED)])
    assert dataset.counts["found"] == 18
    assert dataset.counts["dropped"] == {
        "zero bytes": 1,
        "broken link": 1,
        "file name not UTF-8": 1,
    }
    assert dataset.counts["noted"] == {"no caption (trained with an empty caption)": 5}
    for reason in ("zero.jpg: zero bytes", "dangling.png: broken link", "caf\\xe9.png: file name"):
        assert reason in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        items = {name: dataset[i] for i, name in enumerate(names)}  # one epoch, in order
        summary = dataset.bad_input.summarize_epoch("after epoch 0")
    for name, caption in EXPECTED_CAPTIONS.items():
        assert items[name]["caption"] == caption, name
    assert all(item["image"].shape == (3, 8, 8) for item in items.values())
    assert summary.endswith(
        "2 of 15 items were unreadable and replaced by other samples; 1 caption file with "
        "not UTF-8 (read as cp1252) (each is named once above)"
    )
    for named in ("text.jpg", "truncated.jpg", "rgba.txt: not UTF-8"):
        assert named in caplog.text


def test_the_report_counts_the_messy_folder_and_lists_each_problem(tmp_path, capsys):
    root, _ = _messy_folder(tmp_path / "data")
    config = tmp_path / "data.yaml"
    config.write_text(
        "data:\n  target: lun.data.DataModule\n  params:\n    batch_size: 2\n    train:\n"
        "      target: lun.data.local.Local\n"
        f"      params: {{data_root: '{root}', size: 8, cache_dir: false}}\n"
    )
    assert inspect_data(["--base", str(config), "--decode", "--out", str(tmp_path / "r")]) == 0
    summary = capsys.readouterr().out
    assert "data.train (Local): 13 usable items (2 of the 15 indexed could not be decoded)" in (
        summary
    )
    for line in ("dropped 1 zero bytes", "dropped 1 broken link", "dropped 1 file name not UTF-8"):
        assert line in summary
    assert "not clean UTF-8: {'not UTF-8 (read as cp1252)': 1}" in summary
    for mode in ("'CMYK': 1", "'16-bit': 1", "'P': 1", "'LA': 1", "'RGBA': 1"):
        assert mode in summary


@pytest.mark.parametrize(
    "table, what",
    [
        ("metadata.jsonl", "holds metadata.jsonl; flat files read images/<name>.txt"),
        ("images/metadata.csv", "holds images/metadata.csv; flat files read"),
        ("metadata/0.json", "holds metadata/0.json; set metadata_params"),
        ("images/a.caption", "holds images/a.caption; captions are read from <name>.txt: rename"),
    ],
)
def test_captions_kept_in_a_layout_not_read_are_one_line_exit_2(tmp_path, capsys, table, what):
    """Hugging Face imagefolder's metadata.jsonl, a CSV, metadata mode without metadata_params,
    kohya-ss's .caption files: every image trained with an empty caption after one warning."""
    root = tmp_path / "data"
    _save(root / "images" / "a.png", Image.new("RGB", (8, 8)))
    (root / table).parent.mkdir(parents=True, exist_ok=True)
    (root / table).write_text('{"file_name": "a.png", "text": "a red square"}\n')
    config = tmp_path / "data.yaml"
    config.write_text(
        "data:\n  target: lun.data.DataModule\n  params:\n    train:\n"
        f"      target: lun.data.local.Local\n      params: {{data_root: '{root}', size: 8}}\n"
    )
    assert inspect_data(["--base", str(config), "--out", str(tmp_path / "r")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    (line,) = [e for e in errors if not e.startswith("INFO")]  # Lightning's seed line aside
    assert line.startswith("config error: data.params.train") and what in line
    assert not (tmp_path / "r").exists()


def test_an_empty_or_all_filtered_folder_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no usable items: found no files at all"):
        Local(str(tmp_path / "empty"), size=8, cache_dir=False)
    _save(tmp_path / "bare" / "images" / "a.png", Image.new("RGB", (8, 8)))
    with pytest.raises(ValueError, match=r"found 1 \.png; 1 files skipped \(1 no caption\)"):
        Local(str(tmp_path / "bare"), size=8, cache_dir=False, missing_caption="skip")


def _train_batches(train: dict, batch_size: int, epochs: int = 1) -> list[list[dict]]:
    data = DataModule(train=train, batch_size=batch_size, num_workers=0, seed=0)
    loader = data.train_dataloader()
    return [list(loader) for _ in range(epochs)]


def test_sets_and_buckets_smaller_than_a_batch_say_that_batches_repeat(tmp_path, caplog):
    for i in range(3):
        _save(tmp_path / "few" / "images" / f"{i}.png", Image.new("RGB", (8, 8), (i, 0, 0)))
        (tmp_path / "few" / "images" / f"{i}.txt").write_text(f"picture {i}")
    few = {"data_root": str(tmp_path / "few"), "size": 8, "cache_dir": False}
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        (epoch,) = _train_batches({"target": "lun.data.local.Local", "params": few}, 4)
    assert [len(batch["caption"]) for batch in epoch] == [4]
    assert "data.train: 3 images, fewer than a batch of 4; their batches are filled" in caplog.text

    for i in range(4):
        _save(tmp_path / "buckets" / f"{i}.png", Image.new("RGB", (32, 32)))
    _save(tmp_path / "buckets" / "wide.png", Image.new("RGB", (64, 16)))
    _sideways(tmp_path / "buckets" / "tall.jpg", "JPEG")  # stored 16x8, shown 8x16
    buckets = {"area": 1024, "step": 8}
    params = {"data_root": str(tmp_path / "buckets"), "size": 32, "buckets": buckets}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        (epoch,) = _train_batches({"target": "lun.data.local.Local", "params": params}, 4)
    assert sorted(tuple(batch["image"].shape) for batch in epoch) == [
        (4, 3, 24, 40),  # the one wide image, four times
        (4, 3, 32, 32),
        (4, 3, 40, 24),  # the EXIF-rotated one: a tall bucket, as it is shown
    ]
    assert "2 of 3 buckets hold fewer images than a batch of 4 (24x40: 1, 40x24: 1)" in (
        caplog.text
    )


def test_a_20_image_dreambooth_set_serves_each_image_once_per_epoch(tmp_path, caplog):
    for i in range(20):
        _save(tmp_path / "dog" / f"{i:02d}.png", Image.new("RGB", (8, 8), (i * 12, 0, 0)))
    (tmp_path / "dog" / "empty.png").write_bytes(b"")
    (tmp_path / "dog" / "00.txt").write_text("a dog on grass")  # not read: said so
    params = {"data_root": str(tmp_path / "dog"), "instance_prompt": "a sks dog", "size": 8}
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        epochs = _train_batches(
            {"target": "lun.data.dreambooth.DreamBooth", "params": params}, 4, 3
        )
    assert "empty.png: zero bytes" in caplog.text
    assert "its 1 .txt files are not read - DreamBooth captions every image" in caplog.text
    for batches in epochs:
        reds = sorted(
            round(float(v)) for b in batches for v in (b["image"][:, 0, 0, 0] + 1) * 127.5
        )
        assert reds == [i * 12 for i in range(20)]  # each image once, none twice
        assert {c for b in batches for c in b["caption"]} == {"a sks dog"}
    orders = [
        [round(float(v)) for b in batches for v in b["image"][:, 0, 0, 0] * 100]
        for batches in epochs
    ]
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_class_folders_name_empty_classes_and_skipped_files(tmp_path, caplog):
    _save(tmp_path / "classes" / "cat" / "a.png", Image.new("RGB", (8, 8)))
    (tmp_path / "classes" / "dog").mkdir()
    (tmp_path / "classes" / "dog" / "z.png").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        dataset = ClassFolder(str(tmp_path / "classes"), size=8)
    assert dataset.classes == ["cat", "dog"] and len(dataset) == 1
    assert "z.png: zero bytes" in caplog.text
    assert "class 1 (dog) has no images" in caplog.text
