"""docs/latent-cache.md as a user walks it: cache a folder given on the command line with
`--text`, change a caption, and run the refresh command the training-side check prints. That
command must rebuild the same cache (the folder and the text outputs), not fail on a missing
`data_root` or quietly drop the cached text."""

import shlex

import cache_latents
import pytest
from make_shapes import make_shapes

from lun.data.latent_cache import CachedLatents


def test_the_printed_refresh_command_rebuilds_the_cache_it_names(
    tiny_config, tmp_path, monkeypatch
):
    data, out = tmp_path / "images", tmp_path / "cache"
    make_shapes(data, n=4, size=32, seed=0)
    dataset = {
        "target": "lun.data.local.Local",
        "params": {"data_root": str(data), "size": 32, "cache_dir": False},
    }
    argv = ["--base", str(tiny_config), f"data.params.train.params.data_root={data}"]
    argv += ["data.params.train.params.cache_dir=false", "--out", str(out), "--text"]
    assert cache_latents.main(argv) == 0
    assert CachedLatents(dataset, out).text

    caption = sorted(data.rglob("*.txt"))[0]
    caption.write_text("a caption changed after caching", encoding="utf-8")
    with pytest.raises(ValueError, match="refresh with: ") as stale:
        CachedLatents(dataset, out)
    command = shlex.split(str(stale.value).split("refresh with: ", 1)[1])
    assert command[:2] == ["python", "scripts/cache_latents.py"]

    monkeypatch.chdir(tmp_path)  # as a user runs it, from anywhere
    assert cache_latents.main(command[2:]) == 0
    assert CachedLatents(dataset, out).text  # fresh again, the captions' outputs still cached
