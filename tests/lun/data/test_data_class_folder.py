"""lun.data.class_folder.ClassFolder: ImageNet-style class folders -> image, label, class name."""

import pytest
import torch
from make_shapes import class_names

from lun.data.class_folder import ClassFolder


def test_labels_follow_the_sorted_folder_names(shape_classes_dir):
    """ids as torchvision's ImageFolder (and DiT's train.py) number them; caption = class name."""
    dataset = ClassFolder(str(shape_classes_dir), size=8)
    assert dataset.classes == class_names() and len(dataset.classes) == 18
    assert len(dataset) == 36
    for index in (0, 17, 35):
        item = dataset[index]
        folder = dataset.samples[index][0].split("/")[0]
        assert item["label"] == dataset.classes.index(folder)
        assert item["caption"] == folder
        assert item["image"].shape == (3, 8, 8) and item["image"].min() >= -1


def test_class_names_from_idx_to_prompt(shape_classes_dir, tmp_path):
    names = ClassFolder(str(shape_classes_dir), size=8, idx_to_prompt={"0": ["tench", "a tench"]})
    assert names.class_names[0] == "tench" and names.class_names[1] == names.classes[1]
    listed = ClassFolder(str(shape_classes_dir), size=8, idx_to_prompt=["a", "b"])
    assert listed.class_names[:3] == ["a", "b", listed.classes[2]]


def test_an_unreadable_image_is_replaced_and_bad_roots_are_named(tmp_path, caplog):
    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
    (tmp_path / "cat" / "broken.png").write_bytes(b"not a png")
    from PIL import Image

    Image.new("RGB", (10, 10), (255, 0, 0)).save(tmp_path / "dog" / "red.png")
    dataset = ClassFolder(str(tmp_path), size=4)
    item = dataset[0]  # the broken cat: the next readable item instead
    assert item["label"] == 1 and torch.allclose(item["image"][0], torch.ones(4, 4), atol=0.01)
    assert "broken.png" in caplog.text
    with pytest.raises(ValueError, match="no class folders"):
        ClassFolder(str(tmp_path / "dog"))
    with pytest.raises(ValueError, match="expected a folder"):
        ClassFolder(str(tmp_path / "missing"))
