"""Metadata mode: parsing messy JSON, score and tag filters, captions drawn per sample."""

import json
import logging
import random

import pytest

from lun.data.local import Local
from lun.data.metadata import MetadataError, MetadataParams, build_caption, parse_metadata, select


def _records(*rows):
    """Columns as metadata_records returns them, from (tags, score, aspect) rows."""
    return {
        "image": [f"images/{i}.png" for i in range(len(rows))],
        "tags": [r[0] for r in rows],
        "score": [r[1] for r in rows],
        "aspect": [r[2] if len(r) > 2 else 1.0 for r in rows],
    }


def test_params_validate_and_name_unknown_keys():
    params = MetadataParams.from_config(
        {"shuffle_tag_p": 0.5, "blacklist_tags": ["x"], "aspect_range": [0.5, 2]}
    )
    assert params.blacklist_tags == ("x",) and params.shuffle_tag_p == 0.5
    with pytest.raises(ValueError, match="did you mean 'shuffle_tag_p'"):
        MetadataParams.from_config({"shuffle_tags_p": 0.5})
    with pytest.raises(ValueError, match="shuffle_tag_p"):
        MetadataParams.from_config({"shuffle_tag_p": 2})
    with pytest.raises(ValueError, match="aspect_range"):
        MetadataParams.from_config({"aspect_range": [2, 1]})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"tags": ["a"], "score": 1, "path": "images/a.png"', "malformed JSON"),
        (b"[1, 2]", "malformed JSON"),
        (b"\xff\xfe garbage", "malformed JSON"),
        (b'{"tags": ["a"], "path": "images/a.png"}', "missing field"),
        (b'{"tags": ["a", 3], "score": 1, "path": "images/a.png"}', "malformed field"),
        (b'{"tags": ["a"], "score": "high", "path": "images/a.png"}', "malformed field"),
    ],
)
def test_malformed_or_incomplete_json_is_rejected_with_a_reason(raw, reason):
    with pytest.raises(MetadataError) as info:
        parse_metadata(raw)
    assert info.value.reason == reason


def test_parse_keeps_unicode_tags_and_ignores_extra_keys():
    raw = json.dumps(
        {
            "tags": ["日本語", "café"],
            "score": "12",
            "path": "images/x.png",
            "extra": 1,
            "width": 300,
            "height": 150,
        }
    )
    meta = parse_metadata(("\ufeff" + raw).encode("utf-8"))  # with a byte-order mark, too
    assert meta == {
        "path": "images/x.png",
        "tags": ["日本語", "café"],
        "score": 12.0,
        "aspect": 2.0,
    }
    assert parse_metadata(b'{"tags": "a, b", "score": 1, "path": "p.png", "aspect_ratio": 0.5}')[
        "tags"
    ] == ["a", "b"]


def test_scores_are_checked_before_and_after_bonuses():
    records = _records((["a"], 10), (["a", "good"], 30), (["a"], 30), (["bad"], 100))
    params = MetadataParams.from_config(
        {"abs_min_score": 20, "min_score": 50, "tag_bonus_scores": {"good": 25, "bad": -60}}
    )
    rows, _, filtered = select(records, params)
    assert rows == [1]  # 10 < abs_min even before bonuses; 30 < 50; 100 - 60 < 50
    assert filtered == {"below abs_min_score": 1, "below min_score after bonuses": 2}
    rows, _, _ = select(
        records,
        MetadataParams.from_config({"abs_min_score": 5, "tag_bonus_scores": {"good": -100}}),
    )
    assert rows == [0, 1, 2, 3]  # bonuses never matter for abs_min_score


def test_caption_tags_blacklist_non_caption_replacements_and_score_tags():
    records = _records(
        (["artist:bob", "pony", "high res"], 70), (["pony", "animated"], 500), (["x:y"], 3)
    )
    params = MetadataParams.from_config(
        {
            "blacklist_tags": ["animated"],
            "non_caption_tags": ["high res"],
            "replacements": {"artist:": "by ", ":": "=", "y": ""},  # in order; "y" is removed
            "score_tags": [25, 100, 50],
        }
    )
    rows, captions, filtered = select(records, params)
    assert rows == [0, 2] and filtered == {"blacklisted tag 'animated'": 1}
    # Ordered: "artist:bob" -> "by bob" -> (then "y" removed) "b bob"; score 3 reaches no threshold.
    assert captions == [["b bob", "pon", "scr50"], ["x="]]


def test_aspect_range_is_honoured():
    records = _records((["a"], 1, 0.5), (["b"], 1, 1.0), (["c"], 1, 2.5))
    rows, _, filtered = select(records, MetadataParams.from_config({"aspect_range": [0.7, 1.5]}))
    assert rows == [1] and filtered == {"outside aspect_range": 2}


def test_reshuffle_is_fresh_per_sample_and_keeps_the_first_tokens():
    tags = [f"t{i}" for i in range(8)]
    params = MetadataParams.from_config(
        {"reshuffle_tag_p": 1.0, "keep_tokens": 2, "tag_separator": "|"}
    )
    rng = random.Random(0)
    captions = {build_caption(tags, params, rng) for _ in range(20)}
    assert len(captions) > 10  # drawn afresh each time, not once at load
    assert all(c.startswith("t0|t1|") and sorted(c.split("|")) == sorted(tags) for c in captions)
    assert build_caption(tags, MetadataParams(), rng) == ", ".join(tags)  # never shuffled at p=0
    half = MetadataParams.from_config({"reshuffle_tag_p": 0.5})
    unshuffled = sum(build_caption(tags, half, rng) == ", ".join(tags) for _ in range(200))
    assert 60 < unshuffled < 140


@pytest.fixture
def metadata_folder(tmp_path, writers):
    """10 images with JSON metadata, plus every kind of broken metadata file."""
    root = tmp_path / "meta"
    for i in range(10):
        writers.save(root / "images" / f"{i:02d}.png", size=(40 if i % 2 else 20, 20))
        meta = {
            "tags": [f"tag{i}", "ünï", "common"],
            "score": 10 * i,
            "path": f"images/{i:02d}.png",
            "id": i,
        }
        (root / "metadata" / "x" / f"{i:02d}.json").parent.mkdir(parents=True, exist_ok=True)
        (root / "metadata" / "x" / f"{i:02d}.json").write_text(
            json.dumps(meta, ensure_ascii=False), encoding="utf-8"
        )
    broken = {
        "b1.json": '{"tags": ["a"], "score": 1, "path": ',
        "b2.json": '{"score": 1, "path": "images/00.png"}',
        "b3.json": '{"tags": ["a"], "score": 1, "path": "images/missing.png"}',
        "b4.json": "",
    }
    for name, text in broken.items():
        (root / "metadata" / "y" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "metadata" / "y" / name).write_text(text)
    return root


def test_local_metadata_mode_end_to_end(metadata_folder, caplog):
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(
            str(metadata_folder),
            size=16,
            cache_dir=False,
            metadata_params={"min_score": 20, "non_caption_tags": ["common"], "tag_separator": " "},
        )
    assert len(dataset) == 8  # scores 20..90
    assert dataset[0]["caption"] == "tag2 ünï" and dataset[0]["image"].shape == (3, 16, 16)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
    assert len(skipped) == 4
    assert any("missing field (tags)" in m for m in skipped) and any(
        "image not found" in m for m in skipped
    )
    summary = [r.getMessage() for r in caplog.records if "usable items" in r.getMessage()]
    assert summary == [
        f"{metadata_folder}: 8 usable items; "
        "4 files skipped (2 malformed JSON, 1 missing field, 1 image not found)"
    ]


def test_consider_every_nth_and_aspect_range_from_the_images(metadata_folder):
    every_third = Local(
        str(metadata_folder), size=16, cache_dir=False, metadata_params={"consider_every_nth": 3}
    )
    assert len(every_third) == 4  # files 0, 3, 6, 9 of the 10 good ones (the 4 broken sort after)
    wide = Local(
        str(metadata_folder), size=16, cache_dir=False, metadata_params={"aspect_range": [1.5, 3]}
    )
    assert len(wide) == 5  # the 40 x 20 images; aspect read from the headers
