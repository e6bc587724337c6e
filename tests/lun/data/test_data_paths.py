"""A metadata file cannot make training read files outside data_root: such paths are refused,
counted and reported, and the file they name is never loaded."""

import json
import logging

import pytest

from lun.data.local import Local
from lun.data.metadata import MetadataError, image_path


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("images/a.png", "images/a.png"),
        ("./images//a.png", "images/a.png"),
        ("images/sub/../a.png", "images/a.png"),  # climbs, but stays inside
        ("images\\win\\a.png", "images/win/a.png"),
        ("..a.png", "..a.png"),  # a name that starts with dots, not a parent folder
    ],
)
def test_paths_inside_data_root_are_normalised(path, expected):
    assert image_path(path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "../a.png",
        "images/../../a.png",
        "/etc/a.png",
        "//server/share/a.png",
        "C:\\data\\a.png",
        "..",
    ],
)
def test_paths_leaving_data_root_are_refused(path):
    with pytest.raises(MetadataError) as info:
        image_path(path)
    assert info.value.reason == "path outside data_root" and info.value.detail == path


def test_local_refuses_counts_and_reports_paths_outside_data_root(tmp_path, writers, caplog):
    root = tmp_path / "data"
    outside = writers.save(tmp_path / "secret.png", size=(16, 16))  # exists: must not be read
    writers.save(root / "images" / "ok.png", size=(16, 16))
    paths = {
        "0_ok": "images/ok.png",
        "1_parent": "../secret.png",
        "2_climb": "images/../../secret.png",
        "3_absolute": str(outside),
    }
    (root / "metadata").mkdir()
    for name, path in paths.items():
        meta = {"tags": [name], "score": 1, "path": path}
        (root / "metadata" / f"{name}.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(root), size=8, cache_dir=str(tmp_path / "cache"), metadata_params={})
    assert len(dataset) == 1 and dataset.caption(0) == "0_ok"
    assert dataset.bad_input.skipped == {"path outside data_root": 3}
    messages = [r.getMessage() for r in caplog.records]
    for name in ("1_parent", "2_climb", "3_absolute"):
        line = f"skipped {root}/metadata/{name}.json: path outside data_root ({paths[name]})"
        assert line in messages
    assert f"{root}: 1 usable items; 3 files skipped (3 path outside data_root)" in messages
    # The cached index keeps the refusals: a second start reports them again, loads nothing new.
    again = Local(str(root), size=8, cache_dir=str(tmp_path / "cache"), metadata_params={})
    assert len(again) == 1 and again.bad_input.skipped == {"path outside data_root": 3}
