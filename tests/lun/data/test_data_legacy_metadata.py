"""Metadata configs written for translunar-diffusion run unchanged (issue 14, the dataset part).

That project's `lun.data.local.Local` + `data/metadata/metadata.py` settled each image's caption
once at load: tags minus non-caption tags (and prefixes), plus the score tag; shuffled with
probability `shuffle_tag_p`, else sorted by `caption_sorter` (default: the tag); joined by
`tag_separator` (+ one more with `final_tag_separator`); `skip_caption` gives "". Here the
shuffle draw is seeded per image and run seed, and the per-sample reshuffle is `reshuffle_tag_p`.
"""

import json
import logging
import random

import pytest
from omegaconf import OmegaConf

from ldm.util import instantiate_from_config
from lun.config import ConfigError
from lun.data.local import Local
from lun.data.metadata import MetadataParams, build_caption, select
from lun.rng import seeded
from lun.trainer import build_data

# The data block of translunar-diffusion's configs/training-txt2img.yaml (the write-up's
# recommended config), as written there - tag lists shortened, the caption sorter pointed at a
# module of this test (the original names the user's own `lun.local.tag_sort.tag_sort`), and
# `data_root` given in the block (the original passes `--data_root`).
WRITE_UP_DATA = """
data:
  target: lun.data.DataModule
  params:
    batch_size: 1
    num_workers: 0
    train:
      target: lun.data.local.Local
      params:
        data_root: {root}
        size: 16
        flip_p: 0.333
        cache_dir: false
        metadata_params: &train_metadata_params
          #consider_every_nth: 8
          shuffle_tag_p: 0.5
          caption_sorter:
            target: legacy_tag_sort.tag_sort
          blacklist_tags:
            - animated
            - comic
            - speech bubble
          # tags which aren't needed to determine image contents
          non_caption_tags:
            - absurd resolution
            - absurd res
            - high res
            - oc
          replacements:
            princess luna: luna
            twilight sparkle: twilight
            "soarin'": soarin
            'artist:': 'by:'
            ':': '='
          abs_min_score: 50
          min_score: 200
          score_tags:
            - 3200
            - 1600
            - 800
            - 400
            - 200
            - 150
            - 100
            - 50
          tag_bonus_scores:
            solo: 100
            princess luna: 50
            monochrome: -75
            grayscale: -75
            sketch: -75
    validation:
      target: lun.data.local.Local
      params:
        data_root: {root}
        size: 16
        flip_p: 0.333
        cache_dir: false
        metadata_params:
          << : *train_metadata_params
          consider_every_nth: 8
          abs_min_score: 1000
          min_score: 1000
          tag_bonus_scores: null
          score_tags:
            - 1600
            - 800
"""

# The sort key module the block names: score tags first, then the rest alphabetically. Like the
# original's `instantiate_from_config`, the target is called and its result is the key.
SORTER = """
def tag_sort(first_prefix="scr"):
    return lambda tag: (not tag.startswith(first_prefix), tag)
"""

# (json name, tags, score): the hand-made metadata, in metadata/<sub>/<name>.json (the original's
# glob); "0_top" sorts first, so consider_every_nth: 8 picks it for validation.
IMAGES = [
    ("0_top", ["safe", "princess luna", "solo"], 2000),
    ("1_twi", ["twilight sparkle", "solo", "artist:foo", "absurd res", "safe"], 150),
    ("2_luna", ["princess luna", "monochrome"], 260),
    ("3_comic", ["comic", "solo"], 5000),  # blacklisted
    ("4_low", ["solo"], 40),  # below abs_min_score
    ("5_gray", ["grayscale", "sketch"], 300),  # 300 - 150 < min_score
]
EXPECTED_TRAIN = {  # the caption tags of the images kept, with the write-up's options
    "images/0_top.png": {"scr1600", "safe", "luna", "solo"},
    "images/1_twi.png": {"scr150", "by=foo", "safe", "solo", "twilight"},
    "images/2_luna.png": {"scr200", "monochrome", "luna"},
}
SORTED_TRAIN = {  # and in the unshuffled order: the sorter's (score tag first, then by name)
    "images/0_top.png": "scr1600, princess luna, safe, solo",
    "images/1_twi.png": "scr150, artist:foo, safe, solo, twilight sparkle",
    "images/2_luna.png": "scr200, monochrome, princess luna",
}


def _write_dataset(root, writers, images=IMAGES):
    for name, tags, score in images:
        writers.save(root / "images" / f"{name}.png", size=(16, 16))
        meta = {"tags": tags, "score": score, "path": f"images/{name}.png", "aspect_ratio": 1.0}
        json_path = root / "metadata" / "0" / f"{name}.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(meta))
    return root


@pytest.fixture
def sorter_module(tmp_path, monkeypatch):
    (tmp_path / "legacy_tag_sort.py").write_text(SORTER)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def folder(tmp_path, writers):
    return _write_dataset(tmp_path / "data", writers)


def _replace(caption: str) -> str:
    """The write-up's replacements, applied per tag as the dataset does."""
    rules = {
        "princess luna": "luna",
        "twilight sparkle": "twilight",
        "soarin'": "soarin",
        "artist:": "by:",
        ":": "=",
    }
    tags = caption.split(", ")
    for old, new in rules.items():
        tags = [tag.replace(old, new) for tag in tags]
    return ", ".join(tags)


def _captions(dataset) -> dict[str, str]:
    return {dataset._images[i]: dataset.caption(i) for i in range(len(dataset))}


def test_write_up_data_block_builds_and_gives_its_captions(folder, sorter_module, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "23")
    config = OmegaConf.to_container(
        OmegaConf.create(WRITE_UP_DATA.format(root=folder)), resolve=True
    )
    data = build_data(config["data"])  # how the launcher builds it, before the run folder
    train, validation = data.datasets["train"], data.datasets["validation"]

    captions = _captions(train)
    assert {image: set(c.split(", ")) for image, c in captions.items()} == EXPECTED_TRAIN
    # Each image is shuffled or in the sorter's order, decided once: the same on every read.
    for image, caption in captions.items():
        assert (
            caption == _replace(SORTED_TRAIN[image])
            or set(caption.split(", ")) == (EXPECTED_TRAIN[image])
        )
    assert _captions(train) == captions
    # Validation: every 8th JSON file (0_top), its own thresholds, the merged anchor's rest.
    (caption,) = _captions(validation).values()
    assert list(_captions(validation)) == ["images/0_top.png"]
    assert set(caption.split(", ")) == {"scr1600", "luna", "safe", "solo"}

    # The same config and seed give the same captions in a fresh build (a restart, another rank).
    again = build_data(config["data"]).datasets["train"]
    assert _captions(again) == captions


def test_write_up_block_unshuffled_gives_the_sorted_captions(folder, sorter_module):
    config = OmegaConf.create(WRITE_UP_DATA.format(root=folder))
    config.data.params.train.params.metadata_params.shuffle_tag_p = None  # the original default
    train = instantiate_from_config(OmegaConf.to_container(config.data.params.train, resolve=True))
    assert _captions(train) == {image: _replace(c) for image, c in SORTED_TRAIN.items()}


def _meta_dataset(tmp_path, writers, images, **metadata_params):
    root = tmp_path / "opts"
    if not root.exists():
        _write_dataset(root, writers, images)
    return Local(str(root), size=8, cache_dir=False, metadata_params=metadata_params)


HAND_MADE = [("a", ["zeta", "artist:bob", "alpha", "source:web", "Mid"], 100)]


def test_unshuffled_tags_are_sorted_and_sort_tags_false_keeps_the_file_order(tmp_path, writers):
    dataset = _meta_dataset(tmp_path, writers, HAND_MADE)
    assert dataset.caption(0) == "Mid, alpha, artist:bob, source:web, zeta"  # str order
    kept = _meta_dataset(tmp_path, writers, HAND_MADE, sort_tags=False)
    assert kept.caption(0) == "zeta, artist:bob, alpha, source:web, Mid"
    first_two = _meta_dataset(tmp_path, writers, HAND_MADE, keep_tokens=2)
    assert first_two.caption(0) == "zeta, artist:bob, Mid, alpha, source:web"


def test_caption_sorter_builds_the_sort_key_from_target_and_params(
    tmp_path, writers, sorter_module
):
    sorter = {"target": "legacy_tag_sort.tag_sort", "params": {"first_prefix": "artist:"}}
    dataset = _meta_dataset(tmp_path, writers, HAND_MADE, caption_sorter=sorter)
    assert dataset.caption(0) == "artist:bob, Mid, alpha, source:web, zeta"
    by_length = {"target": "legacy_tag_sort.tag_sort", "params": {"first_prefix": "s"}}
    assert _meta_dataset(tmp_path, writers, HAND_MADE, caption_sorter=by_length).caption(0) == (
        "source:web, Mid, alpha, artist:bob, zeta"
    )


def test_final_tag_separator_prefixes_and_skip_caption(tmp_path, writers):
    final = _meta_dataset(tmp_path, writers, HAND_MADE, final_tag_separator=True, tag_separator=" ")
    assert final.caption(0) == "Mid alpha artist:bob source:web zeta "
    # Prefixes work alone (the original only honoured them beside non_caption_tags) and with it.
    hidden = _meta_dataset(
        tmp_path, writers, HAND_MADE, non_caption_tag_prefixes=["artist:", "source:"]
    )
    assert hidden.caption(0) == "Mid, alpha, zeta"
    both = _meta_dataset(
        tmp_path, writers, HAND_MADE, non_caption_tags=["Mid"], non_caption_tag_prefixes="art"
    )
    assert both.caption(0) == "alpha, source:web, zeta"
    # skip_caption: the filters still choose the images, every caption is "".
    images = [*HAND_MADE, ("b", ["x"], 1)]
    skipped = _meta_dataset(tmp_path / "s", writers, images, skip_caption=True, min_score=50)
    assert len(skipped) == 1 and skipped[0]["caption"] == "" and skipped.caption(0) == ""
    skipped_final = _meta_dataset(
        tmp_path / "s", writers, images, skip_caption=True, final_tag_separator=True
    )
    assert [skipped_final.caption(i) for i in range(2)] == ["", ""]


def _records(n: int) -> dict:
    tags = [f"t{i}" for i in range(6)]
    return {
        "image": [f"images/{i}.png" for i in range(n)],
        "tags": [list(tags) for _ in range(n)],
        "score": [1] * n,
        "aspect": [1.0] * n,
    }


def test_shuffle_tag_p_shuffles_each_image_once_seeded_by_image_and_seed():
    records, in_order = _records(400), [f"t{i}" for i in range(6)]
    half = MetadataParams.from_config({"shuffle_tag_p": 0.5})
    state = random.getstate()
    random.seed(1)
    _, first, _ = select(records, half, seed=7)
    random.seed(2)  # the global stream plays no part ...
    _, second, _ = select(records, half, seed=7)
    assert first == second
    random.seed(1)
    _, other_seed, _ = select(records, half, seed=8)
    random.setstate(state)
    assert other_seed != first  # ... the run's seed does
    assert all(sorted(tags) == in_order for tags in first)
    shuffled = sum(tags != in_order for tags in first)
    assert 150 < shuffled < 250  # about half (an unlucky shuffle may give the sorted order)
    # The per-sample step leaves that order alone unless reshuffle_tag_p asks.
    rng = random.Random(0)
    assert {build_caption(first[0], half, rng) for _ in range(20)} == {", ".join(first[0])}


def test_shuffle_once_is_the_same_on_every_read_and_leaves_the_global_stream(tmp_path, writers):
    images = [(f"i{n}", [f"t{i}" for i in range(8)], 1) for n in range(6)]
    state = random.getstate()
    dataset = _meta_dataset(tmp_path, writers, images, shuffle_tag_p=1.0)
    assert random.getstate() == state  # indexing draws nothing from `random`
    captions = [dataset.caption(i) for i in range(len(dataset))]
    for key in [(0, 0, 0), (0, 1, 5)]:
        with seeded(key):
            assert [dataset[i]["caption"] for i in range(len(dataset))] == captions
    assert len(set(captions)) > 1 and all(len(c.split(", ")) == 8 for c in captions)


def test_reshuffle_tag_p_draws_per_sample_from_the_seeded_streams(tmp_path, writers):
    images = [("a", [f"t{i}" for i in range(8)], 1)]
    dataset = _meta_dataset(tmp_path, writers, images, reshuffle_tag_p=1.0, keep_tokens=1)
    draws = []
    for epoch in range(6):
        with seeded((0, epoch, 0)):
            draws.append(dataset.caption(0))
    with seeded((0, 3, 0)):
        assert dataset.caption(0) == draws[3]  # the same batch key, the same caption (resume)
    assert len(set(draws)) > 3 and all(d.startswith("t0, ") for d in draws)


@pytest.mark.parametrize("mode", ["train", "val", "validation"])
def test_mode_of_old_configs_is_accepted_with_one_warning(folder, mode, caplog):
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        dataset = Local(str(folder), size=8, cache_dir=False, metadata_params={}, mode=mode)
    assert len(dataset) == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"mode={mode!r}: has no effect")


def _data_config(folder, **params) -> dict:
    return {
        "target": "lun.data.DataModule",
        "params": {
            "train": {
                "target": "lun.data.local.Local",
                "params": {"data_root": str(folder), "size": 8, "cache_dir": False, **params},
            }
        },
    }


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"mode": "test"}, "data.params.train.params.mode='test': expected one of 'train'"),
        (
            {"path": "x"},
            "data.params.train.params.path: not a parameter of lun.data.local.Local "
            "(open-diffusion's name); here it is data_root",
        ),
        (
            {"resolution": 512},
            "data.params.train.params.resolution: not a parameter of "
            "lun.data.local.Local (open-diffusion's name); here it is size",
        ),
        (
            {"workers": 4},
            "data.params.train.params.workers: not a parameter of "
            "lun.data.local.Local (open-diffusion's name); here it is num_workers",
        ),
        (
            {"flip": 0.5},
            "data.params.train.params.flip: not a parameter of "
            "lun.data.local.Local; did you mean 'flip_p'?",
        ),
        (
            {"metadata_params": {"skip_caption": "yes"}},
            "data.params.train.params.metadata_params.skip_caption='yes': expected true or false",
        ),
        (
            {"metadata_params": {"caption_sorter": {"target": "no_such_module.key"}}},
            "data.params.train.params.metadata_params.caption_sorter: cannot build",
        ),
        (
            {"metadata_params": {"reshuffle_tag_p": 1.5}},
            "data.params.train.params.metadata_params.reshuffle_tag_p=1.5: expected a probability",
        ),
    ],
)
def test_wrong_dataset_keys_are_one_line_config_errors_naming_them(folder, params, expected):
    with pytest.raises(ConfigError) as info:
        build_data(_data_config(folder, **params))
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message
