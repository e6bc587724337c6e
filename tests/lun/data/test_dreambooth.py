"""lun.data.dreambooth.DreamBooth: instance/class pairing, the collated batch, its checks, and the
class images drawn by the base model (once)."""

import numpy as np
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


@pytest.mark.slow
def test_class_images_are_drawn_by_the_base_model_once(tmp_path, tiny_config):
    from lora_helpers import build

    from ldm.checkpoint import save_safetensors
    from lun.config import merge_configs, to_container
    from lun.generation import starting_noise, to_pil

    base = build(tiny_config, None)  # moved weights: images depend on them, and on the seed
    save_safetensors(base.state_dict(), tmp_path / "base.safetensors")
    model_config = to_container(merge_configs([tiny_config]))["model"]
    model_config["params"]["ckpt_path"] = str(tmp_path / "base.safetensors")
    class_root = tmp_path / "class"
    folder(class_root, 1, BLUE)  # one given by the user: two more to draw
    params = {
        "data_root": folder(tmp_path / "sks", 1, RED),
        "instance_prompt": "a sks circle",
        "class_data_root": str(class_root),
        "class_prompt": "a circle",
        "num_class_images": 3,
        "class_model": model_config,
        "sample_steps": 2,
        "sample_scale": 3.0,
        "size": 16,
    }
    data = DreamBooth(**params)
    drawn = sorted(class_root.glob("class-*.png"))
    assert [p.name for p in drawn] == ["class-00000.png", "class-00001.png"]
    assert len(data.class_images) == 3 and not list(class_root.glob(".*"))  # no temporary left
    with Image.open(drawn[1]) as image:
        assert image.text["parameters"].startswith(
            "a circle\nSteps: 2, Sampler: DDIM, CFG scale: 3.0, Seed: 1"
        )
        pixels = np.asarray(image)
    # image 1 is the base model's sample from seed 1
    noise = starting_noise([1], base.latent_shape(16, 16), torch.device("cpu"))
    with torch.no_grad():
        expected = base.eval().sample(
            ["a circle"], steps=2, scale=3.0, height=16, width=16, noise=noise
        )
    assert np.abs(pixels.astype(int) - np.asarray(to_pil(expected[0])).astype(int)).max() <= 1

    # the next run finds them: nothing drawn (a broken model config would fail if it were built)
    stamps = [p.stat().st_mtime_ns for p in drawn]
    DreamBooth(**{**params, "class_model": {"target": "not.a.Model"}})
    assert [p.stat().st_mtime_ns for p in drawn] == stamps
    # one lost: drawn again, the same image from the same seed
    drawn[1].unlink()
    DreamBooth(**params)
    assert np.array_equal(np.asarray(Image.open(drawn[1])), pixels)
