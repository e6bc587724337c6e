"""WebDataset shards and Parquet files written here: filters, rank/worker splits, bad samples."""

import json
import logging

import pytest
import torch
from torch.utils.data import DataLoader

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.data.webdataset import Parquet, WebDataset, check_filters, parse_filters
from lun.legacy import translate_legacy_keys


@pytest.fixture
def shards(tmp_path, writers):
    """4 shards x 6 samples; sample n has width 20 + n, pwatermark n / 24, and every 5th no json."""
    n = 0
    for s in range(4):
        samples = []
        for _ in range(6):
            files = {
                "jpg": writers.jpeg_bytes((24, 16), seed=n),
                "txt": f"c{n:02d}",
                "cls": str(n % 3),
            }
            if n % 5:
                files["json"] = json.dumps({"width": 20 + n, "pwatermark": n / 24})
            samples.append((f"{n:05d}", files))
            n += 1
        writers.shard(tmp_path / f"shard-{s:03d}.tar", samples)
    return tmp_path


def _captions(dataset, num_workers=0, **configure):
    dataset.configure(**{"batch_size": 2, **configure})
    batches = list(DataLoader(dataset, batch_size=None, num_workers=num_workers))
    for batch in batches:
        assert batch["image"].dtype == torch.float32 and batch["image"].shape == (2, 3, 8, 8)
    return [c for batch in batches for c in batch["caption"]]


def test_filter_syntax():
    filters = parse_filters({"key": ">=512", "pwatermark": "<= 0.5", "status": "success", "n": 3})
    assert filters == [
        ("key", ">=", 512.0),
        ("pwatermark", "<=", 0.5),
        ("status", "==", "success"),
        ("n", "==", 3.0),
    ]
    assert (
        check_filters({"key": 600, "pwatermark": 0.1, "status": "success", "n": 3}, filters) is None
    )
    assert check_filters({"key": 600, "status": "success", "n": 3}, filters) == "missing pwatermark"
    assert (
        check_filters({"key": 100, "pwatermark": 0, "status": "success", "n": 3}, filters)
        == "key not >= 512"
    )
    assert check_filters({"a": {"b": 2}}, parse_filters({"a.b": ">1"})) is None
    with pytest.raises(ValueError, match="needs a number"):
        parse_filters({"key": ">= large"})


def test_not_equal_filter_drops_only_the_matching_value():
    filters = parse_filters({"status": "!=failed", "width": "!= 21"})
    assert filters == [("status", "!=", "failed"), ("width", "!=", 21.0)]
    assert check_filters({"status": "success", "width": 22}, filters) is None
    assert check_filters({"status": "failed", "width": 22}, filters) == "status not != failed"
    assert check_filters({"status": "success", "width": 21}, filters) == "width not != 21"


def test_not_equal_filter_on_a_stream(shards):
    dataset = WebDataset(
        str(shards / "shard-{000..003}.tar"),
        num_examples_to_see=18,
        size=8,
        filters={"width": "!=21"},
    )
    captions = _captions(dataset, shuffle=False)
    with_json = [f"c{n:02d}" for n in range(24) if n % 5]  # width 20 + n; every 5th has no json
    assert captions == [c for c in with_json if c != "c01"]  # one pass, in shard order


def test_filters_drop_samples_and_samples_missing_a_filtered_key(shards):
    dataset = WebDataset(
        str(shards / "shard-{000..003}.tar"),
        num_examples_to_see=10,
        size=8,
        filters={"width": ">=30", "pwatermark": "<=0.75"},
        shuffle_buffer=4,
    )
    captions = _captions(dataset)
    assert len(dataset) == 5
    assert len(captions) == 10
    allowed = {
        f"c{n:02d}" for n in range(10, 19) if n % 5
    }  # width >= 30, pwatermark <= .75, has json
    assert set(captions) <= allowed and len(set(captions)) == len(
        allowed
    )  # cycles to fill the epoch


def test_two_ranks_and_two_workers_split_the_shards_and_agree_on_length(shards):
    per_rank = []
    for rank in range(2):
        dataset = WebDataset(
            str(shards / "shard-{000..003}.tar"), num_examples_to_see=12, size=8, shuffle_buffer=4
        )
        captions = _captions(dataset, num_workers=2, rank=rank, world_size=2, seed=1)
        assert len(dataset) == 3 and len(captions) == 6
        per_rank.append(captions)
    shard_of = lambda caption: int(caption[1:]) // 6  # noqa: E731
    shards_seen = [{shard_of(c) for c in captions} for captions in per_rank]
    assert not shards_seen[0] & shards_seen[1]  # 4 shards over 4 (rank, worker) slots: no overlap


def test_order_is_deterministic_per_seed_and_epoch(shards):
    dataset = WebDataset(
        str(shards / "shard-{000..003}.tar"), num_examples_to_see=8, size=8, shuffle_buffer=5
    )
    first = _captions(dataset, seed=4)
    assert _captions(dataset, seed=4) == first
    dataset.set_epoch(1)
    assert _captions(dataset, seed=4) != first


def test_bad_images_and_truncated_shards_are_dropped_not_fatal(tmp_path, writers, caplog):
    good = [(f"g{i}", {"jpg": writers.jpeg_bytes(seed=i), "txt": f"good {i}"}) for i in range(4)]
    bad = [("bad", {"jpg": b"not a jpeg", "txt": "bad"}), ("noimage", {"txt": "no image"})]
    writers.shard(tmp_path / "a.tar", good[:2] + bad)
    last = (
        "g3",
        {"txt": "good 3", "jpg": writers.jpeg_bytes(seed=3)},
    )  # its image is the last file
    full = writers.shard(tmp_path / "b.tar", [good[2], last]).read_bytes()
    (tmp_path / "b.tar").write_bytes(
        full[: len(full.rstrip(b"\0")) - 100]
    )  # cut inside the last file
    shard_list = [str(tmp_path / "a.tar"), str(tmp_path / "b.tar"), str(tmp_path / "gone.tar")]
    dataset = WebDataset(shard_list, 6, size=8, shuffle_buffer=2)
    with caplog.at_level(logging.INFO, logger="lun.data"):
        captions = _captions(dataset)
    assert len(captions) == 6 and set(captions) == {f"good {i}" for i in range(3)}
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "gone.tar does not exist" in messages
    assert "dropped " + str(tmp_path / "a.tar") + ":bad: not a readable image" in messages
    assert "b.tar: ReadError" in messages
    assert "no image" in messages  # in the worker's summary of what it left out


def test_pipe_urls(shards):
    dataset = WebDataset(
        "pipe:cat " + str(shards / "shard-{000..001}.tar"), num_examples_to_see=4, size=8
    )
    assert _captions(dataset, shuffle=False) == ["c00", "c01", "c02", "c03"]


def test_class_conditional_mode(shards, tmp_path):
    (tmp_path / "classes.json").write_text(
        json.dumps({"0": "a tench", "1": ["a goldfish", "goldfish"]})
    )
    dataset = WebDataset(
        str(shards / "shard-{000..003}.tar"),
        num_examples_to_see=8,
        size=8,
        idx_to_prompt=str(tmp_path / "classes.json"),
        shuffle_buffer=8,
    )
    captions = _captions(dataset)
    assert len(captions) == 8 and set(captions) <= {
        "a tench",
        "a goldfish",
        "goldfish",
    }  # class 2 has no prompt
    # each item also carries its class id, the label a class-conditional model (DiT) reads
    for batch in DataLoader(dataset, batch_size=None):
        for label, caption in zip(batch["label"].tolist(), batch["caption"], strict=True):
            assert caption == "a tench" if label == 0 else caption in ("a goldfish", "goldfish")
    with pytest.raises(ValueError, match="class ids"):
        WebDataset(str(shards / "shard-000.tar"), 4, idx_to_prompt={"n01440764": "tench"})


def test_transform_parameters_apply_to_streams(shards):
    dataset = WebDataset(
        str(shards / "shard-{000..003}.tar"),
        num_examples_to_see=4,
        size=8,
        interpolation="lanczos",
        crop="random",
        flip_p=1.0,
        shuffle_buffer=2,
    )
    assert len(_captions(dataset)) == 4
    with pytest.raises(ValueError, match="crop='left'"):
        WebDataset(str(shards / "shard-000.tar"), 4, crop="left")


def test_missing_shards_and_length_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no shards found"):
        WebDataset(str(tmp_path / "none-{0..3}.tar"), num_examples_to_see=4)
    with pytest.raises(ValueError, match="num_examples_to_see"):
        WebDataset("pipe:true", num_examples_to_see=0)


def test_parquet_source_with_filters_and_hf_image_structs(tmp_path, writers):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [writers.jpeg_bytes(seed=i) for i in range(6)]
    table = pa.table(
        {
            "jpg": images,
            "text": [f"p{i}" for i in range(6)],
            "aesthetic": [float(i) for i in range(6)],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    structs = pa.table(
        {
            "jpg": [{"bytes": b, "path": None} for b in images[:2]],
            "text": ["s0", "s1"],
            "aesthetic": [9.0, 9.0],
        }
    )
    pq.write_table(structs, tmp_path / "b.parquet")
    dataset = Parquet(
        str(tmp_path / "{a,b}.parquet"),
        image_column="jpg",
        caption_column="text",
        size=8,
        filters={"aesthetic": ">=3"},
        shuffle_buffer=4,
    )
    captions = _captions(dataset)
    assert dataset.num_examples_to_see == 8 and len(dataset) == 4
    assert len(captions) == 8 and set(captions) == {"p3", "p4", "p5", "s0", "s1"}
    labelled = pa.table({"img": images[:4], "label": [0, 1, 0, 1]})
    pq.write_table(labelled, tmp_path / "c.parquet")
    classes = Parquet(
        str(tmp_path / "c.parquet"),
        image_column="img",
        class_column="label",
        idx_to_prompt=["a cat", "a dog"],
        size=8,
        shuffle_buffer=2,
    )
    assert sorted(_captions(classes, shuffle=False)) == ["a cat", "a cat", "a dog", "a dog"]


def _legacy_train_split(tmp_path, target: str, params: str):
    """The train split of an old config with `caption_dropout: 1.0`, through lun.config."""
    config = tmp_path / "legacy.yaml"
    config.write_text(
        "model: {target: ldm.diffusion.LatentDiffusion, params: {}}\n"
        f"data:\n  params:\n    train:\n      target: {target}\n"
        f"      params: {{{params}, size: 8, caption_dropout: 1.0}}\n"
    )
    built = to_container(translate_legacy_keys(merge_configs([config])))
    assert built["model"]["params"] == {"ucg_rate": 1.0}  # the probability is the model's now
    return instantiate_from_config(built["data"]["params"]["train"])


def test_legacy_caption_dropout_leaves_stream_captions_alone(shards, tmp_path, writers):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    dataset = _legacy_train_split(
        tmp_path,
        "lun.data.webdataset.WebDataset",
        f"urls: '{shards / 'shard-{000..003}.tar'}', num_examples_to_see: 8, shuffle_buffer: 4",
    )
    for epoch in range(2):
        dataset.set_epoch(epoch)
        captions = _captions(dataset, num_workers=2)
        assert len(captions) == 8 and all(c.startswith("c") for c in captions)
    table = pa.table(
        {"image": [writers.jpeg_bytes(seed=i) for i in range(4)], "caption": list("wxyz")}
    )
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    parquet = _legacy_train_split(
        tmp_path, "lun.data.webdataset.Parquet", f"paths: '{tmp_path / 'p.parquet'}'"
    )
    assert _captions(parquet, shuffle=False) == ["w", "x", "y", "z"]
    for stream in (WebDataset, Parquet):
        with pytest.raises(TypeError, match="caption_dropout"):  # the streams no longer take it
            stream("unused", 4, caption_dropout=0.5)


def test_stream_captions_follow_byte_order_marks_and_count_legacy_text(tmp_path, writers, caplog):
    samples = [
        (
            "u16",
            {"jpg": writers.jpeg_bytes(seed=0), "txt": "\ufeffcafé au lait".encode("utf-16-le")},
        ),
        ("cp", {"jpg": writers.jpeg_bytes(seed=1), "txt": "naïve".encode("cp1252")}),
        ("u8", {"jpg": writers.jpeg_bytes(seed=2), "txt": "\ufeffplain".encode("utf-8")}),
        ("ok", {"jpg": writers.jpeg_bytes(seed=3), "txt": "ok"}),
    ]
    dataset = WebDataset(str(writers.shard(tmp_path / "a.tar", samples)), 4, size=8)
    with caplog.at_level(logging.INFO, logger="lun.data"):
        captions = _captions(dataset, shuffle=False)
    assert captions == ["café au lait", "naïve", "plain", "ok"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "'caption not UTF-8 (read as cp1252)': 1" in messages


def test_memory_probe_takes_a_streams_first_batch_and_leaves_the_stream(shards):
    """A stream cannot be indexed: the memory plan's probe reads its first batch at the batch
    size, and the run's own loader then yields what it yields without a probe."""
    from lun.data import DataModule
    from lun.memory_probe import probe_batch

    def module():
        urls = str(shards / "shard-{000..003}.tar")
        train = {"target": "lun.data.webdataset.WebDataset", "params": {"urls": urls, "size": 8}}
        train["params"]["num_examples_to_see"] = 12
        data = DataModule(train=train, batch_size=3, seed=1)
        data.setup("fit")
        return data

    probed = module()
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    batch = probe_batch(probed)
    assert torch.equal(torch.rand(1), expected)  # the run's random streams as they were
    assert batch["image"].shape == (3, 3, 8, 8) and len(batch["caption"]) == 3
    first, fresh = next(iter(probed.train_dataloader())), next(iter(module().train_dataloader()))
    assert first["caption"] == fresh["caption"] and torch.equal(first["image"], fresh["image"])
