"""The other sources fed what users have: WebDataset shards whose captions sit under another key,
Parquet files with other column names or types, metadata folders with missing files, wrong
types, duplicate rows and a stray .jsonl, and the latent cache of a folder with broken images.
Each is read correctly, counted and named, or refused in one line naming the key."""

import codecs
import io
import json
import logging
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from lun.data.local import Local
from lun.data.webdataset import Parquet, WebDataset
from lun.trainer import build_data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import cache_latents  # noqa: E402


def _png(color=(200, 10, 10), size=(16, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def _shard(path, samples) -> str:
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _captions(stream, batch_size=2) -> list[str]:
    stream.configure(batch_size=batch_size, shuffle=False)
    return [caption for batch in stream for caption in batch["caption"]]


def test_a_shard_without_the_caption_key_is_refused_before_the_run(tmp_path):
    samples = [(f"{i:03d}", {"jpg": _png(), "caption": b"cap %d" % i}) for i in range(4)]
    url = _shard(tmp_path / "s.tar", samples)
    train = {"target": "lun.data.webdataset.WebDataset", "params": {"urls": url}}
    train["params"].update(num_examples_to_see=4, size=8, shuffle_buffer=1)
    data = {"target": "lun.data.DataModule", "params": {"batch_size": 2, "train": train}}
    with pytest.raises(ValueError) as refused:  # what main.py and inspect_data.py call
        build_data(data)
    line = str(refused.value)
    assert line.startswith("data.params.train: caption_key='txt': none of the first 4 samples")
    assert "(they have .caption, .jpg); set caption_key" in line and "\n" not in line

    assert _captions(WebDataset(url, 4, size=8, caption_key="caption")) == [
        f"cap {i}" for i in range(4)
    ]
    unconditional = WebDataset(url, 4, size=8, caption_key=None)
    unconditional.check_readable()  # a set without captions, said so
    assert _captions(unconditional) == [""] * 4


def test_parquet_columns_are_checked_by_name_and_type(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [_png() for _ in range(4)]
    pq.write_table(pa.table({"image": images, "text": list("abcd")}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"image": images, "caption": [1, 2, 3, 4]}), tmp_path / "i.parquet")
    pq.write_table(
        pa.table({"image": list("abcd"), "caption": list("abcd")}), tmp_path / "s.parquet"
    )
    for name, key, message in (
        ("t", {}, "caption_column='caption': {} has no such column (its columns: image, text)"),
        ("t", {"image_column": "jpg", "caption_column": "text"}, "image_column='jpg': {} has no"),
        ("i", {}, "caption_column='caption': {} holds int64 there, expected text"),
        ("s", {}, "image_column='image': {} holds string there, expected encoded image bytes"),
    ):
        path = str(tmp_path / f"{name}.parquet")
        with pytest.raises(ValueError) as refused:
            Parquet(path, size=8, **key)
        assert str(refused.value).startswith(message.format(path)), refused.value

    assert _captions(Parquet(str(tmp_path / "t.parquet"), caption_column="text", size=8)) == list(
        "abcd"
    )
    raw = [codecs.BOM_UTF8 + b"bom\r\n", "utf16".encode("utf-16"), "café".encode("cp1252"), b"x"]
    texts = ["\ufeffbom in text\r\n", "b", None, "d"]
    pq.write_table(
        pa.table({"image": images, "caption": raw, "text": texts}), tmp_path / "b.parquet"
    )
    assert _captions(Parquet(str(tmp_path / "b.parquet"), size=8)) == ["bom", "utf16", "café", "x"]
    in_text = Parquet(str(tmp_path / "b.parquet"), caption_column="text", size=8)
    assert _captions(in_text) == ["bom in text", "b", "", "d"]


def test_metadata_rows_that_cannot_be_used_are_counted_and_named(tmp_path, caplog):
    root = tmp_path / "tagged"
    (root / "images").mkdir(parents=True)
    (root / "metadata").mkdir()
    (root / "images" / "a.png").write_bytes(_png())
    rows = {
        "0": {"tags": ["red"], "score": 5, "path": "images/a.png"},
        "1": {"tags": ["red"], "score": 5, "path": "images/a.png"},  # a duplicate row: kept
        "2": {"tags": ["red"], "score": 5, "path": "images/missing.png"},
        "3": {"tags": ["red"], "score": "high", "path": "images/a.png"},
        "4": {"tags": 7, "score": 5, "path": "images/a.png"},
        "5": {"tags": "red, square", "score": "6", "path": "images/a.png", "width": "wide"},
    }
    for name, row in rows.items():
        (root / "metadata" / f"{name}.json").write_text(json.dumps(row))
    (root / "metadata" / "all.jsonl").write_text(json.dumps(rows["0"]) + "\n")
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        dataset = Local(str(root), size=8, cache_dir=False, metadata_params={})
    assert dataset.counts["found"] == 7 and dataset.counts["usable"] == 3
    assert dataset.counts["dropped"] == {
        "malformed field": 2,
        "image not found": 1,
        "not a .json file": 1,
    }
    assert [dataset.caption(i) for i in range(3)] == ["red", "red", "red, square"]
    for named in ("2.json: image not found", "3.json: malformed field ('score'", "all.jsonl"):
        assert named in caplog.text


def test_the_latent_cache_names_the_images_it_could_not_read(tmp_path, tiny_config, caplog):
    root = tmp_path / "data" / "images"
    root.mkdir(parents=True)
    for i in range(2):
        (root / f"{i}.png").write_bytes(_png((i * 90, 10, 10), (16, 16)))
        (root / f"{i}.txt").write_bytes(codecs.BOM_UTF8 + b"picture %d" % i)
    jpeg = io.BytesIO()
    Image.new("RGB", (16, 16), (9, 99, 199)).save(jpeg, "JPEG")
    (root / "truncated.jpg").write_bytes(jpeg.getvalue()[:200])  # cut inside its scan
    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={root.parent}"]
    args += ["data.params.train.params.size=16", "data.params.train.params.cache_dir=false"]
    with caplog.at_level(logging.WARNING, logger="lun"):
        assert cache_latents.main([*args, "--out", str(tmp_path / "cache"), "--workers", "0"]) == 0
    assert "1 images could not be read" in caplog.text and "truncated.jpg (" in caplog.text


@pytest.mark.parametrize(
    "option, line",
    [
        (["--batch-size", "0"], "--batch-size=0: expected a whole number >= 1"),
        (["--shard-size", "-3"], "--shard-size=-3: expected a whole number >= 1"),
        (["--workers", "-1"], "--workers=-1: expected a whole number >= 0"),
        (["--processes", "0"], "--processes=0: expected a whole number >= 1"),
        (["--out", "FILE"], "FILE: is a file, not a folder; give the cache folder as --out"),
    ],
)
def test_cache_options_out_of_range_are_one_line_exit_2(
    tmp_path, tiny_config, capsys, option, line
):
    """A batch size of 0 failed mid-run, a negative shard size wrote an empty cache, a file as
    --out was a traceback."""
    (tmp_path / "FILE").write_text("")
    option = [str(tmp_path / "FILE") if a == "FILE" else a for a in option]
    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={tmp_path}"]
    out = [] if "--out" in option else ["--out", str(tmp_path / "cache")]
    assert cache_latents.main([*args, *out, *option]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "config error: " + line.replace(
        "FILE", str(tmp_path / "FILE")
    )
    assert not (tmp_path / "cache").exists()


def test_make_metadata_set_refuses_sizes_below_one(tmp_path, monkeypatch, capsys):
    import make_metadata_set

    for option in (["--items", "0"], ["--image-size", "0"]):
        monkeypatch.setattr(sys, "argv", ["make_metadata_set.py", "--out", str(tmp_path / "s")])
        sys.argv += option
        with pytest.raises(SystemExit) as stopped:
            make_metadata_set.main()
        assert stopped.value.code == 2
        assert f"error: {option[0]}=0: expected a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
