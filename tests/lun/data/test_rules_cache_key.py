"""Every input of the latent cache's keys. The rule of content addressing, stated apart from the
code: an entry's key must change whenever its value would (else a stale latent or text embedding
is reused silently), and stay the same when nothing it depends on changed (else the cache is
rebuilt for nothing). The value is checked directly: the decoded pixels (for latents) and the
caption after the dataset's rules (for text), from the real dataset and model."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ldm.model_contract import module_fingerprint
from lun.config import merge_configs, to_container
from lun.data.latent_cache import file_sha256, item_keys, latent_key, text_key
from lun.data.local import Local
from lun.trainer import build_model

BASE = {"size": 24, "interpolation": "bicubic", "crop": "center", "flip_p": 0.0, "cache_dir": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One 40 x 28 noise image with a caption, and the same image in metadata mode."""
    root = tmp_path_factory.mktemp("keys")
    (root / "images").mkdir()
    (root / "captions").mkdir()
    (root / "metadata").mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (28, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "images" / "0.png")
    (root / "captions" / "0.txt").write_text("a red square")
    meta = {"tags": ["zeta", "alpha_beta", "gamma"], "score": 5, "path": "images/0.png"}
    (root / "metadata" / "0.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def model(tiny_config):
    torch.manual_seed(0)
    return build_model(to_container(merge_configs([tiny_config], []))["model"])


def fingerprints(model) -> dict:
    """What scripts/cache_latents.py records of the model."""
    return {
        "first_stage": module_fingerprint(model.first_stage_model),
        "kind": "posterior",
        "scale_factor": float(model.scale_factor),
        "text": module_fingerprint(model.conditioner),
    }


def dataset(folder, **settings):
    params = {**BASE, **settings}
    if "metadata_params" in params:
        params.pop("cache_dir")
    return Local(str(folder), **params)


def keys_and_value(folder, model_keys, **settings):
    data = dataset(folder, **settings)
    file = {"sha256": file_sha256(str(folder / data.image_name(0)))}
    keys = item_keys(data, 0, model_keys, file, text=True)
    return keys, data[0]["image"], data.caption(0)


IMAGE_VARIANTS = {
    "interpolation bilinear": {"interpolation": "bilinear"},
    "interpolation lanczos": {"interpolation": "lanczos"},
    "size": {"size": 16},
    "buckets": {"buckets": {"area": 576, "step": 8}},
}


@pytest.mark.parametrize("variant", list(IMAGE_VARIANTS))
def test_an_image_setting_that_changes_the_pixels_changes_the_latent_key(folder, model, variant):
    model_keys = fingerprints(model)
    keys, pixels, _ = keys_and_value(folder, model_keys)
    other_keys, other_pixels, _ = keys_and_value(folder, model_keys, **IMAGE_VARIANTS[variant])
    assert other_pixels.shape != pixels.shape or not torch.equal(other_pixels, pixels)
    assert other_keys["latent"] != keys["latent"]
    assert other_keys["text"] == keys["text"]  # the caption did not change


def test_settings_that_leave_the_pixels_alone_keep_the_keys(folder, model):
    """flip_p only chooses between the two stored orientations; the caption file is not an
    input of the latent."""
    model_keys = fingerprints(model)
    keys, pixels, _ = keys_and_value(folder, model_keys, flip_p=0.5)
    again, _, _ = keys_and_value(folder, model_keys, flip_p=0.9)
    assert again == keys
    assert keys["latent_flip"] not in (None, keys["latent"])  # the mirrored image: its own entry


def test_another_image_file_changes_only_its_latent_keys(folder, model, tmp_path):
    model_keys = fingerprints(model)
    data = dataset(folder)
    keys = item_keys(
        data, 0, model_keys, {"sha256": file_sha256(str(folder / "images/0.png"))}, True
    )
    changed = tmp_path / "0.png"
    Image.new("RGB", (40, 28), (1, 2, 3)).save(changed)
    other = item_keys(data, 0, model_keys, {"sha256": file_sha256(str(changed))}, True)
    assert other["latent"] != keys["latent"] and other["text"] == keys["text"]


def test_the_vae_weights_kind_and_scale_factor_are_in_the_latent_key(model):
    settings = {"crop": "center", "interpolation": "bicubic", "max_pixels": 1}
    model_keys = fingerprints(model)
    key = latent_key(model_keys, settings, (24, 24), False, "sha")
    vae = model.first_stage_model
    weight = next(p for p in vae.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.view(-1)[0] += 1e-3  # one value of one weight
        moved = {**model_keys, "first_stage": module_fingerprint(vae)}
        weight.copy_(saved)
    assert latent_key(moved, settings, (24, 24), False, "sha") != key
    assert module_fingerprint(vae) == model_keys["first_stage"]  # restored: the same again
    for name, value in (("kind", "sample"), ("scale_factor", 0.13025)):
        assert latent_key({**model_keys, name: value}, settings, (24, 24), False, "sha") != key
    # the text encoder is no input of a latent
    assert latent_key({**model_keys, "text": "other"}, settings, (24, 24), False, "sha") == key


def test_the_text_encoder_weights_and_settings_are_in_the_text_key(model):
    model_keys = fingerprints(model)
    key = text_key(model_keys, "a red square")
    conditioner = model.conditioner
    weight = next(p for p in conditioner.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.view(-1)[0] += 1e-3
        moved = module_fingerprint(conditioner)
        weight.copy_(saved)
    assert text_key({**model_keys, "text": moved}, "a red square") != key
    for name, value in (("max_length", 16), ("layer", "penultimate")):
        saved = getattr(conditioner, name)
        setattr(conditioner, name, value)
        try:
            assert module_fingerprint(conditioner) != model_keys["text"], name
        finally:
            setattr(conditioner, name, saved)
    # Caption dropout is drawn at training time, after the cache: not an input.
    saved = getattr(conditioner, "ucg_rate", 0.0)
    conditioner.ucg_rate = 0.5
    try:
        assert module_fingerprint(conditioner) == model_keys["text"]
    finally:
        conditioner.ucg_rate = saved
    assert text_key(model_keys, "a red square.") != key


CAPTION_RULES = {
    "tag_separator": {"tag_separator": " "},
    "replacements": {"replacements": {"_": " "}},
    "keep_tokens": {"keep_tokens": 1},
    "sort_tags": {"sort_tags": False},
    "non_caption_tags": {"non_caption_tags": ["gamma"]},
    "score_tags": {"score_tags": [5]},
    "final_tag_separator": {"final_tag_separator": True},
}


@pytest.mark.parametrize("rule", list(CAPTION_RULES))
def test_a_caption_rule_that_changes_the_caption_changes_only_the_text_key(folder, model, rule):
    model_keys = fingerprints(model)
    keys, _, caption = keys_and_value(folder, model_keys, metadata_params={})
    other_keys, _, other_caption = keys_and_value(
        folder, model_keys, metadata_params=CAPTION_RULES[rule]
    )
    assert other_caption != caption
    assert other_keys["text"] != keys["text"]
    assert other_keys["latent"] == keys["latent"]
