"""Every metadata option at its boundary, against the rule the MetadataParams docstring states
(and translunar-diffusion's data/metadata/metadata.py, where these options come from):
"below" a threshold means strictly below (a score equal to it is kept), `score_tags` is reached
at score >= N, `aspect_range` includes both ends, `keep_tokens` tags never move, and the
per-image shuffle is drawn once (seeded) while `reshuffle_tag_p` draws per sample."""

import json
import random

import pytest

from lun.data.metadata import MetadataParams, build_caption, metadata_records, select

TAIL = ["delta", "alpha", "echo", "charlie", "bravo", "foxtrot"]  # sorted: alpha ... foxtrot


def records(*rows):
    """rows of (tags, score, aspect) -> the columns `select` reads; images named by row."""
    return {
        "image": [f"images/{i}.png" for i in range(len(rows))],
        "tags": [list(r[0]) for r in rows],
        "score": [r[1] for r in rows],
        "aspect": [r[2] if len(r) > 2 else 1.0 for r in rows],
    }


def params(**config):
    return MetadataParams.from_config(config)


def kept(data, **config):
    return select(data, params(**config))[0]


def test_abs_min_score_keeps_a_score_equal_to_it():
    data = records((["a"], 4.999), (["a"], 5), (["a"], 5.001))
    assert kept(data, abs_min_score=5) == [1, 2]


def test_abs_min_score_is_checked_on_the_raw_score_before_bonuses():
    data = records((["good"], 4), (["good"], 5))
    assert kept(data, abs_min_score=5, tag_bonus_scores={"good": 10}) == [1]


def test_min_score_counts_the_bonuses_of_the_tags_an_image_has_and_keeps_equality():
    data = records((["good"], 3), (["plain"], 3), (["good", "bad"], 6), (["plain"], 4.99))
    # 3 + 2 = 5 kept (equal); 3 dropped; 6 + 2 - 3 = 5 kept; 4.99 dropped
    assert kept(data, min_score=5, tag_bonus_scores={"good": 2, "bad": -3}) == [0, 2]


def test_score_tags_name_the_highest_threshold_reached():
    data = records((["a"], 100), (["a"], 99.5), (["a"], 50), (["a"], 49.9), (["a"], 24))
    _, captions, _ = select(data, params(score_tags=[25, 100, 50]))
    assert [[t for t in c if t.startswith("scr")] for c in captions] == [
        ["scr100"],
        ["scr50"],
        ["scr50"],
        ["scr25"],
        [],
    ]


def test_aspect_range_includes_both_ends():
    data = records(*[(["a"], 0, aspect) for aspect in (0.49, 0.5, 1.0, 2.0, 2.01)])
    assert kept(data, aspect_range=[0.5, 2.0]) == [1, 2, 3]


def test_blacklisted_tags_drop_the_image_even_when_hidden_from_the_caption():
    data = records((["a", "nsfw"], 0), (["a"], 0))
    assert kept(data, blacklist_tags=["nsfw"], non_caption_tags=["nsfw"]) == [1]


def test_hidden_tags_still_earn_their_bonus_but_leave_the_caption():
    data = records((["artist:x", "source:y", "meta", "cat"], 0))
    rows, captions, _ = select(
        data,
        params(
            non_caption_tags=["meta"],
            non_caption_tag_prefixes=["artist:", "source:"],
            tag_bonus_scores={"meta": 1},
            min_score=1,
        ),
    )
    assert rows == [0] and captions == [["cat"]]


@pytest.mark.parametrize("keep_tokens", [1, 2, 3])
def test_the_per_image_shuffle_never_moves_the_first_keep_tokens_tags(keep_tokens):
    head = ["zulu", "yankee", "xray"][:keep_tokens]  # out of sort order on purpose
    data = records(*[(head + TAIL, 0)] * 40)
    _, captions, _ = select(data, params(shuffle_tag_p=1.0, keep_tokens=keep_tokens))
    assert all(c[:keep_tokens] == head for c in captions)
    assert all(sorted(c[keep_tokens:]) == sorted(TAIL) for c in captions)
    assert len({tuple(c) for c in captions}) > 1  # the tails were shuffled, differently


def test_unshuffled_tags_are_sorted_after_keep_tokens_or_kept_in_file_order():
    data = records((["zulu", *TAIL], 0))
    assert select(data, params(keep_tokens=1))[1] == [["zulu", *sorted(TAIL)]]
    assert select(data, params(keep_tokens=1, sort_tags=False))[1] == [["zulu", *TAIL]]


def test_shuffle_tag_p_is_the_fraction_of_images_shuffled():
    """p = 0.2 over 600 images: a shuffled tail of 6 tags is sorted only 1 time in 720, so the
    unsorted fraction estimates p (binomial sd ~0.016; the bounds are 5 sd)."""
    data = records(*[(TAIL, 0)] * 600)
    _, captions, _ = select(data, params(shuffle_tag_p=0.2), seed=3)
    shuffled = sum(c != sorted(TAIL) for c in captions) / len(captions)
    assert 0.12 < shuffled < 0.28


def test_the_per_image_order_is_the_same_on_every_start_and_changes_with_the_seed():
    data = records(*[(TAIL, 0)] * 20)
    first = select(data, params(shuffle_tag_p=1.0), seed=7)[1]
    assert select(data, params(shuffle_tag_p=1.0), seed=7)[1] == first
    assert select(data, params(shuffle_tag_p=1.0), seed=8)[1] != first


def test_reshuffle_draws_per_sample_and_keeps_the_first_keep_tokens():
    settings = params(reshuffle_tag_p=1.0, keep_tokens=2)
    tags = ["zulu", "yankee", *TAIL]
    rng = random.Random(0)
    captions = [build_caption(tags, settings, rng).split(", ") for _ in range(30)]
    assert all(c[:2] == ["zulu", "yankee"] for c in captions)
    assert len({tuple(c) for c in captions}) > 1
    never = params(reshuffle_tag_p=0.0)
    assert build_caption(tags, never, rng) == ", ".join(tags)


def test_replacements_apply_in_order_and_an_emptied_tag_is_dropped():
    data = records((["artist:bob", "drop", "a_b"], 0))
    _, captions, _ = select(
        data,
        params(replacements={"artist:": "by ", "drop": "", "_": " "}, sort_tags=False),
    )
    assert captions == [["by bob", "a b"]]


def test_separators_and_skip_caption():
    tags = ["a", "b"]
    assert build_caption(tags, params(tag_separator=" | ")) == "a | b"
    assert build_caption(tags, params(final_tag_separator=True)) == "a, b, "
    assert build_caption(tags, params(skip_caption=True)) == ""
    assert select(records((tags, 0)), params(skip_caption=True))[1] == [[]]


def test_consider_and_exclude_every_nth_split_the_files_in_two(tmp_path):
    listing = []
    for i in range(7):
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "images" / f"{i}.png").write_bytes(b"x")
        meta = tmp_path / "metadata" / f"{i}.json"
        meta.parent.mkdir(exist_ok=True)
        meta.write_text(json.dumps({"tags": [], "score": 0, "path": f"images/{i}.png"}))
        listing += [(f"metadata/{i}.json", 10, 0), (f"images/{i}.png", 1, 0)]

    def images(**nth):
        found = metadata_records(lambda rel: str(tmp_path / rel), listing, **nth)[0]["image"]
        return [int(name.split("/")[1].split(".")[0]) for name in found]

    assert images(every_nth=3) == [0, 3, 6]  # every 3rd in sorted order, from the first
    assert images(every_nth=None, exclude_every_nth=3) == [1, 2, 4, 5]
    assert images(every_nth=None) == list(range(7))
