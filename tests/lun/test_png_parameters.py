"""The PNGs of txt2img carry their parameters as AUTOMATIC1111 writes them, read by its own rules.

The expected values are computed here, independently of `lun.generation` and `ldm.checkpoint`:
the "Model hash" is what AUTOMATIC1111 shows for a model file (the first 10 hex digits of its
SHA-256), and the text is parsed as AUTOMATIC1111's `parse_generation_parameters` parses it.
"""

import hashlib
from pathlib import Path

import pytest
import torch
import txt2img
from PIL import Image
from png_helpers import parse_a1111_parameters

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


def test_the_parser_reads_a_line_written_by_automatic1111():
    # A parameters chunk as AUTOMATIC1111 1.x writes it (quoted values may hold commas).
    text = (
        "a cat, sitting\nNegative prompt: blurry\n"
        "Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7, Seed: 1, Size: 512x768, "
        'Model hash: 6ce0161689, Lora hashes: "a: 1, b: 2", Version: v1.6.0'
    )
    assert parse_a1111_parameters(text) == {
        "Prompt": "a cat, sitting",
        "Negative prompt": "blurry",
        "Steps": "20",
        "Sampler": "DPM++ 2M Karras",
        "CFG scale": "7",
        "Seed": "1",
        "Size-1": "512",
        "Size-2": "768",
        "Model hash": "6ce0161689",
        "Lora hashes": '"a: 1, b: 2"',
        "Version": "v1.6.0",
    }


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory, tiny_config) -> Path:
    """The tiny model's random weights as a plain `.ckpt` (no training needed to test metadata)."""
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    path = tmp_path_factory.mktemp("model") / "random.ckpt"
    torch.save({"state_dict": model.state_dict()}, path)
    return path


@pytest.mark.parametrize("negative", ["blurry, dark", ""])
def test_txt2img_parameters_read_back_by_automatic1111_rules(
    tmp_path, tiny_config, random_checkpoint, negative
):
    prompt = "a red circle, on a blue ground"
    txt2img.main(
        [
            "--config",
            str(tiny_config),
            "--ckpt",
            str(random_checkpoint),
            "--outdir",
            str(tmp_path),
            "--prompt",
            prompt,
            "--negative-prompt",
            negative,
            "--steps",
            "2",
            "--sampler",
            "euler_a",
            "--scale",
            "3.5",
            "--seed",
            "11",
            "--n_samples",
            "2",
            "--W",
            "40",
            "--H",
            "24",
            "--skip_grid",
            "--device",
            "cpu",
        ]
    )
    # AUTOMATIC1111's "Model hash" of a file: sha256 of its bytes, first 10 hex digits.
    model_hash = hashlib.sha256(random_checkpoint.read_bytes()).hexdigest()[:10]
    samples = sorted((tmp_path / "samples").glob("*.png"))
    assert [p.name for p in samples] == ["00000.png", "00001.png"]
    for index, path in enumerate(samples):
        image = Image.open(path)
        assert image.size == (40, 24)
        fields = parse_a1111_parameters(image.text["parameters"])
        assert fields == {
            "Prompt": prompt,
            "Negative prompt": negative,
            "Steps": "2",
            "Sampler": "Euler a",
            "CFG scale": "3.5",
            "Seed": str(11 + index),
            "Size-1": "40",
            "Size-2": "24",
            "Model hash": model_hash,
        }
