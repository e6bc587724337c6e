"""lun.data.dreambooth.DreamBooth: instance/class pairing, the collated batch, its checks (the
class images are drawn before, by lun.prior_images: tests/lun/test_prior_images.py)."""

import pytest
import torch
from PIL import Image

from lun.data.datamodule import DataModule
from lun.data.dreambooth import DreamBooth

RED, BLUE = (220, 20, 20), (20, 20, 220)


def folder(path, count, color):
    """`count` solid images of `color`, each a little brighter, so each is recognisable."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (8, 8), tuple(c + 3 * i for c in color)).save(path / f"{i:02d}.png")
    return str(path)


def shade(image: torch.Tensor) -> int:
    """Which image of `folder` this is (inverse of its brightness step), from the tensor."""
    pixel = ((image[:, 0, 0] + 1) * 127.5).round()
    return int((pixel.max() - 220) / 3)


def test_items_pair_instance_and_class_images_as_diffusers_does(tmp_path):
    data = DreamBooth(
        folder(tmp_path / "sks", 3, RED),
        "a sks circle",
        class_data_root=folder(tmp_path / "class", 5, BLUE),
        class_prompt="a circle",
        size=8,
    )
    assert len(data) == 5  # max(instance, class)
    for i in range(5):
        item = data[i]
        assert shade(item["image"]) == i % 3 and item["image"][0, 0, 0] > 0  # red
        assert shade(item["class_image"]) == i % 5 and item["class_image"][2, 0, 0] > 0  # blue
        assert (item["caption"], item["class_caption"]) == ("a sks circle", "a circle")


def test_a_batch_is_the_instance_images_then_the_class_images_with_eq2_weights(tmp_path):
    data = DreamBooth(
        folder(tmp_path / "sks", 2, RED),
        "a sks circle",
        class_data_root=folder(tmp_path / "class", 4, BLUE),
        class_prompt="a circle",
        prior_loss_weight=0.3,
        size=8,
    )
    batch = data.collate([data[1], data[2], data[3]])
    assert batch["image"].shape == (6, 3, 8, 8)
    assert batch["caption"] == ["a sks circle"] * 3 + ["a circle"] * 3
    assert [shade(x) for x in batch["image"]] == [1, 0, 1, 1, 2, 3]
    torch.testing.assert_close(batch["loss_weight"], torch.tensor([2, 2, 2, 0.6, 0.6, 0.6]))


def test_without_a_class_folder_items_are_instance_images_only(tmp_path):
    data = DreamBooth(folder(tmp_path / "sks", 3, RED), "a sks circle", size=8)
    assert len(data) == 3 and not data.prior
    batch = data.collate([data[0], data[2]])
    assert set(batch) == {"image", "caption"} and batch["image"].shape == (2, 3, 8, 8)


def test_the_datamodule_serves_the_pairs_in_one_batch(tmp_path):
    params = {
        "data_root": folder(tmp_path / "sks", 2, RED),
        "instance_prompt": "a sks circle",
        "class_data_root": folder(tmp_path / "class", 2, BLUE),
        "class_prompt": "a circle",
        "size": 8,
    }
    data = DataModule({"target": "lun.data.dreambooth.DreamBooth", "params": params}, batch_size=2)
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].shape == (4, 3, 8, 8) and batch["loss_weight"].tolist() == [2] * 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data_root": "missing"}, "data_root="),
        ({"instance_prompt": ""}, "instance_prompt="),
        ({"class_prompt": None}, "class_prompt=None: prior preservation needs"),
        ({"num_class_images": 5}, "class_data_root=.*: 2 images, num_class_images=5; add"),
        ({"num_class_images": 0}, "num_class_images=0: expected a whole number > 0"),
        ({"prior_loss_weight": -1}, "prior_loss_weight=-1"),
        ({"class_model": {"params": {}}}, "class_model: expected a model config"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(tmp_path, change, message):
    params = {
        "data_root": folder(tmp_path / "sks", 1, RED),
        "instance_prompt": "a sks circle",
        "class_data_root": folder(tmp_path / "class", 2, BLUE),
        "class_prompt": "a circle",
        "size": 8,
    }
    if change.get("data_root") == "missing":
        change = {"data_root": str(tmp_path / "missing")}
    with pytest.raises(ValueError, match=message):
        DreamBooth(**{**params, **change})


def test_the_dataset_reads_a_folder_and_never_draws(tmp_path):
    """With `class_model` and too few class images, the dataset (built without the launcher's
    drawing step) names the step instead of building a model."""
    params = {
        "data_root": folder(tmp_path / "sks", 1, RED),
        "instance_prompt": "a sks circle",
        "class_data_root": folder(tmp_path / "class", 1, BLUE),
        "class_prompt": "a circle",
        "num_class_images": 2,
        "class_model": {"target": "not.a.Model"},  # would fail if it were built
        "size": 8,
    }
    with pytest.raises(ValueError, match="1 images, num_class_images=2; draw them first: lun"):
        DreamBooth(**params)
