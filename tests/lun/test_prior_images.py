"""lun.prior_images: DreamBooth's missing class images, drawn by the base model before the data
is built (once: a rerun draws nothing, a lost image is drawn again the same)."""

import numpy as np
import pytest
import torch
from PIL import Image

from lun.data.dreambooth import DreamBooth
from lun.prior_images import draw_missing_class_images

RED, BLUE = (220, 20, 20), (20, 20, 220)


def folder(path, count, color):
    path.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (8, 8), tuple(c + 3 * i for c in color)).save(path / f"{i:02d}.png")
    return str(path)


def data_config(params: dict) -> dict:
    dataset = {"target": "lun.data.dreambooth.DreamBooth", "params": params}
    return {"target": "lun.data.DataModule", "params": {"batch_size": 1, "train": dataset}}


def test_settings_are_checked_before_anything_is_drawn(tmp_path):
    params = {
        "data_root": str(tmp_path / "missing"),
        "instance_prompt": "a sks circle",
        "class_data_root": str(tmp_path / "class"),
        "class_prompt": "a circle",
        "num_class_images": 2,
        "class_model": {"target": "not.a.Model"},  # would fail if it were built
    }
    with pytest.raises(ValueError, match="data_root="):
        draw_missing_class_images(data_config(params))
    params["data_root"] = folder(tmp_path / "sks", 1, RED)
    with pytest.raises(ValueError, match="sample_steps=0"):
        draw_missing_class_images(data_config({**params, "sample_steps": 0}))
    assert not (tmp_path / "class").exists()
    # no class model, or another dataset: nothing to draw, nothing built
    assert draw_missing_class_images(data_config({**params, "class_model": None})) == []
    other = {"target": "lun.data.local.Local", "params": {"class_model": "x"}}
    assert draw_missing_class_images({"params": {"train": other}}) == []


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
    written = draw_missing_class_images(data_config(params))
    drawn = sorted(class_root.glob("class-*.png"))
    assert sorted(written) == [str(p) for p in drawn]
    data = DreamBooth(**params)  # reads the folder
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
    assert (
        draw_missing_class_images(data_config({**params, "class_model": {"target": "x.Y"}})) == []
    )
    assert [p.stat().st_mtime_ns for p in drawn] == stamps
    # one lost: drawn again, the same image from the same seed
    drawn[1].unlink()
    draw_missing_class_images(data_config(params))
    assert np.array_equal(np.asarray(Image.open(drawn[1])), pixels)
