"""scripts/cache_latents.py as users run it: two processes write the cache one process writes;
bad input is one line and exit status 2."""

import subprocess
import sys

import cache_latents
import pytest
import torch
from run_helpers import ROOT
from safetensors.torch import load_file


def args(tiny_config, data_root, out, *extra) -> list[str]:
    return [
        "--base",
        str(tiny_config),
        f"data.params.train.params.data_root={data_root}",
        "data.params.train.params.cache_dir=false",
        "--out",
        str(out),
        "--shard-size",
        "3",
        "--workers",
        "0",
        *extra,
    ]


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes(tiny_config, shapes_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert cache_latents.main(args(tiny_config, shapes_dir, one, "--text")) == 0
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cache_latents.py")]
        + args(tiny_config, shapes_dir, two, "--text", "--processes", "2"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 0" in result.stderr and "rank 1" in result.stderr  # a bar per process
    assert "img/s" in result.stderr
    names = sorted(p.name for p in one.iterdir())
    assert (
        names[0] == "index.json" and len(names) == 1 + 11
    )  # index + 32 units (16 images, 16 captions) in shards of 3
    assert names == sorted(p.name for p in two.iterdir())
    assert (one / "index.json").read_text() == (two / "index.json").read_text()
    for name in names[1:]:  # shards: equal up to the float rounding of 1 vs 2 threads
        mine, theirs = load_file(one / name), load_file(two / name)
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            torch.testing.assert_close(theirs[key], value, rtol=1e-4, atol=1e-5)


def test_bad_input_is_one_line_and_status_2(tiny_config, shapes_dir, tmp_path, capsys):
    cases = [
        (
            ["--base", str(tiny_config)],
            "missing required value 'data.params.train.params.data_root'",
        ),
        (
            args(tiny_config, shapes_dir, tmp_path / "c", "data.params.train.params.crop=random"),
            "crop='random'",
        ),
        (args(tiny_config, shapes_dir, "", "--nope"), "unknown option --nope"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert cache_latents.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1], err
        assert not any("Traceback" in line for line in err), err
    assert not (tmp_path / "c").exists()
