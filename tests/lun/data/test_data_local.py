"""lun.data.local.Local in flat-file mode: parameters, messy folders, the index cache."""

import logging
import os
import time

import pytest
import torch

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.data.local import Local
from lun.legacy import translate_legacy_keys

SIZE_KEYS = ("original_size_as_tuple", "crop_coords_top_left", "target_size_as_tuple")


def _captions(dataset):
    return sorted(dataset[i]["caption"] for i in range(len(dataset)))


def test_flat_files_with_captions_beside_or_in_captions_folder(flat_folder):
    dataset = Local(str(flat_folder), size=16, cache_dir=False)
    assert len(dataset) == 6
    item = dataset[0]
    assert set(item) == {"image", "caption", *SIZE_KEYS}
    assert item["image"].dtype == torch.float32 and item["image"].shape == (3, 16, 16)
    assert -1 <= item["image"].min() and item["image"].max() <= 1
    assert _captions(dataset) == [f"caption {i}" for i in range(6)]


def test_images_without_caption_are_kept_empty_with_a_warning_or_skipped(flat_folder, caplog):
    (flat_folder / "captions" / "a" / "1.txt").unlink()
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        dataset = Local(str(flat_folder), size=16, cache_dir=False)
    assert len(dataset) == 6 and _captions(dataset)[0] == ""
    assert any("1.png: no caption" in r.getMessage() for r in caplog.records)
    assert len(Local(str(flat_folder), size=16, cache_dir=False, missing_caption="skip")) == 5
    with pytest.raises(ValueError, match="missing_caption='drop'"):
        Local(str(flat_folder), cache_dir=False, missing_caption="drop")


def test_a_folder_without_any_caption_says_so_in_one_line(flat_folder, caplog):
    """A folder of images alone (6 here): one line, not a note per image; still 6 with none."""
    for caption in (flat_folder / "captions").rglob("*.txt"):
        caption.unlink()
    for caption in flat_folder.rglob("*.txt"):  # captions beside the images
        caption.unlink()
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(flat_folder), size=16, cache_dir=False)
    assert _captions(dataset) == [""] * 6
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "caption" in m] == [
        f"{flat_folder}: no image has a caption: all 6 train with an empty caption (the caption "
        "of images/a.png is captions/a.txt or images/a.txt)",
        f"{flat_folder}: 6 usable items; 6 with no caption",
    ]


def test_legacy_caption_dropout_reaches_the_model_and_the_dataset_keeps_captions(
    flat_folder, tmp_path
):
    """`caption_dropout: 1.0` in an old config: every caption still comes back, every pass; the
    probability is the model's ucg_rate (tests/lun/test_config.py covers the translation)."""
    config = tmp_path / "legacy.yaml"
    config.write_text(
        "model: {target: ldm.diffusion.LatentDiffusion}\n"
        "data:\n  target: lun.data.DataModule\n  params:\n    train:\n"
        "      target: lun.data.local.Local\n"
        f"      params: {{data_root: '{flat_folder}', size: 8, cache_dir: false, "
        "caption_dropout: 1.0}\n"
    )
    built = to_container(translate_legacy_keys(merge_configs([config])))
    assert built["model"]["params"] == {"ucg_rate": 1.0}
    dataset = instantiate_from_config(built["data"]["params"]["train"])
    for _ in range(3):
        assert _captions(dataset) == [f"caption {i}" for i in range(6)]
    with pytest.raises(TypeError, match="caption_dropout"):  # the dataset no longer takes it
        Local(str(flat_folder), cache_dir=False, caption_dropout=0.5)


def test_flip_crop_interpolation_and_limit(flat_folder):
    plain = Local(str(flat_folder), size=8, cache_dir=False, interpolation="bilinear")
    flipped = Local(str(flat_folder), size=8, cache_dir=False, interpolation="bilinear", flip_p=1.0)
    assert torch.equal(flipped[5]["image"], plain[5]["image"].flip(-1))
    random_crop = Local(
        str(flat_folder), size=8, cache_dir=False, crop="random", interpolation="lanczos"
    )
    assert random_crop[5]["image"].shape == (3, 8, 8)
    limited = Local(str(flat_folder), size=8, cache_dir=False, limit_images=4)
    assert len(limited) == 4 and _captions(limited) == _captions(
        Local(str(flat_folder), size=8, cache_dir=False, limit_images=4)
    )
    for bad in ({"flip_p": 1.5}, {"crop": "top"}, {"interpolation": "nearest"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Local(str(flat_folder), cache_dir=False, **bad)


@pytest.fixture
def messy_folder(flat_folder, writers):
    """The flat folder plus one file of every bad kind (and some good odd ones)."""
    images = flat_folder / "images"
    data = writers.jpeg_bytes((64, 64))
    (images / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (images / "zero.png").write_bytes(b"")
    (images / "notes.jpg").write_text("not an image")
    (images / "bomb.png").write_bytes(writers.bomb_png(60000, 60000))
    (images / "._hidden.jpg").write_bytes(b"\0\0 macOS resource fork")
    (images / "readme.md").write_text("ignored")
    writers.save(images / "cmyk.jpg", mode="CMYK", color=(0, 255, 255, 0))
    writers.save(images / "gray.webp", mode="L", color=90)
    writers.save(images / "palette.bmp", mode="P", color=3)
    writers.exif_rotated(images / "rotated.jpg")
    return flat_folder


def test_bad_files_are_skipped_or_substituted_and_reported_once(messy_folder, caplog):
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(messy_folder), size=16, cache_dir=False)
        # zero.png is left out at indexing (cheap); the others are found at load time.
        assert len(dataset) == 13
        for _ in range(2):  # two epochs: the bad files must be named once only
            items = [dataset[i] for i in range(len(dataset))]
    assert all(item["image"].shape == (3, 16, 16) for item in items)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("zero.png: zero bytes" in m for m in messages) == 1
    for name in ("truncated.jpg", "notes.jpg", "bomb.png"):
        assert (
            sum(m.startswith(f"unreadable {messy_folder}/images/{name}") for m in messages) == 1
        ), name
    assert int(dataset.bad_input.failed.sum()) == 3
    assert "3 of 13 items were unreadable" in dataset.bad_input.summarize_epoch("after epoch 0")


def test_verify_images_leaves_non_images_out_at_indexing(messy_folder, caplog):
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(messy_folder), size=16, cache_dir=False, verify_images=True)
    assert len(dataset) == 11  # notes.jpg and bomb.png fail their header; truncated.jpg's is fine
    summary = [r.getMessage() for r in caplog.records if "usable items" in r.getMessage()]
    assert summary == [
        f"{messy_folder}: 11 usable items; 3 files skipped (1 zero bytes, 1 decompression bomb, "
        "1 not a readable image), 5 with no caption"
    ]


def test_a_folder_without_usable_items_fails_at_start_saying_what_it_found(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.gif").write_bytes(b"GIF89a")
    (tmp_path / "images" / "b.png").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        Local(str(tmp_path), cache_dir=False)
    message = str(info.value)
    assert str(tmp_path) in message and "1 .gif" in message and "1 zero bytes" in message
    with pytest.raises(ValueError, match="does not exist"):
        Local(str(tmp_path / "nope"))


def test_max_image_pixels_refuses_large_images(flat_folder):
    with pytest.raises(ValueError, match="6 decompression bomb"):
        Local(str(flat_folder), cache_dir=False, verify_images=True, max_image_pixels=100)
    assert (
        len(Local(str(flat_folder), cache_dir=False, verify_images=True, max_image_pixels=24 * 48))
        == 3
    )


def test_images_directly_in_data_root_are_accepted(tmp_path, writers):
    writers.save(tmp_path / "x.jpg")
    (tmp_path / "x.txt").write_text("beside")
    assert Local(str(tmp_path), size=8, cache_dir=False)[0]["caption"] == "beside"


def test_index_cache_is_used_and_invalidated_by_changes(flat_folder, tmp_path, writers, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="lun.data"):
        Local(str(flat_folder), cache_dir=str(cache), buckets=True)
        assert not any("(from cache)" in r.getMessage() for r in caplog.records)
        caplog.clear()
        assert len(Local(str(flat_folder), cache_dir=str(cache), buckets=True)) == 6
        assert any("(from cache)" in r.getMessage() for r in caplog.records)
        caplog.clear()
        writers.save(flat_folder / "images" / "new.png")
        assert len(Local(str(flat_folder), cache_dir=str(cache), buckets=True)) == 7
        assert not any("(from cache)" in r.getMessage() for r in caplog.records)
    (cache / os.listdir(cache)[0]).write_text(
        "{half written"
    )  # a broken cache file only costs time
    assert len(Local(str(flat_folder), cache_dir=str(cache), buckets=True)) == 7


def test_indexing_many_files_opens_no_image_and_is_fast(tmp_path):
    images = tmp_path / "big" / "images"
    for folder in range(4):
        (images / f"{folder:02d}").mkdir(parents=True)
        for i in range(500):  # 2000 "images" that are not even images: nothing may open them
            (images / f"{folder:02d}" / f"{i}.jpg").write_bytes(b"x")
    start = time.perf_counter()
    dataset = Local(str(tmp_path / "big"), cache_dir=False, missing_caption="empty")
    assert len(dataset) == 2000
    assert time.perf_counter() - start < 2.0  # ~0.1 s; 100k images + captions take ~2 s


def test_buckets_give_each_image_its_nearest_aspect(tmp_path, writers):
    for i, size in enumerate([(64, 32), (60, 34), (32, 64), (48, 48), (90, 40)]):
        writers.save(tmp_path / "images" / f"{i}.png", size=size)
    dataset = Local(str(tmp_path), size=32, cache_dir=False, buckets={"step": 8, "max_aspect": 2.0})
    shapes = [tuple(dataset[i]["image"].shape[1:]) for i in range(5)]
    assert shapes == [(24, 40), (24, 40), (40, 24), (32, 32), (24, 40)]  # (H, W)
    assert [dataset.item_size(i) for i in range(5)] == [(w, h) for h, w in shapes]
