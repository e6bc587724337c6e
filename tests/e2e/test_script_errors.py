"""txt2img, img2img and convert on broken files and a full disk: one line, never a traceback.

A refused, damaged or missing input is one line on stderr naming the file, exit status 2; a
failed write is the system's words and the output path ("No space left on device (<path>)"),
exit status 1. (Checkpoints holding code: tests/ldm/test_safe_load.py.)
"""

import errno
import subprocess
import sys
from pathlib import Path

import convert
import img2img
import pytest
import torch
import txt2img
from PIL import Image
from run_helpers import ROOT

from ldm import checkpoint
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def weights(tmp_path_factory, tiny_config) -> Path:
    """The tiny model's weights as an original-layout .safetensors file."""
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    checkpoint.save_safetensors(model.state_dict(), path)
    return path


def truncated(source: Path, out: Path) -> Path:
    """The first half of `source`: a download or a copy that stopped."""
    data = source.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out


def exit_of(main, argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of a script's main(argv) run in this process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, capsys.readouterr().err.splitlines()


def generation_argv(script, tmp_path: Path, ckpt: Path, tiny_config: Path) -> list[str]:
    argv = ["--ckpt", str(ckpt), "--config", str(tiny_config), "--outdir", str(tmp_path / "out")]
    argv += ["--steps", "1", "--device", "cpu"]
    if script is img2img:
        Image.new("RGB", (32, 32), "white").save(tmp_path / "init.png")
        argv += ["--init-img", str(tmp_path / "init.png")]
    return argv


@pytest.mark.parametrize("script", [txt2img, img2img, convert], ids=lambda s: s.__name__)
def test_truncated_safetensors_is_one_line_naming_the_file(
    tmp_path, capsys, weights, tiny_config, script
):
    broken = truncated(weights, tmp_path / "model.safetensors")
    if script is convert:
        argv = [str(broken), str(tmp_path / "out.safetensors")]
    else:
        argv = generation_argv(script, tmp_path, broken, tiny_config)
    status, lines = exit_of(script.main, argv, capsys)
    assert status == 2
    assert len(lines) == 1, lines
    flag = "" if script is convert else "--ckpt "  # the flag that named it, when one did
    assert lines[0].startswith(f"error: {flag}{broken}: not a readable .safetensors file"), lines
    assert "incomplete metadata" in lines[0]  # safetensors' own words kept as the detail


def test_truncated_ckpt_is_one_line_naming_the_file(tmp_path, capsys, weights):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": checkpoint.load_file_state(weights), "global_step": 2}, whole)
    broken = truncated(whole, tmp_path / "model.ckpt")
    status, lines = exit_of(convert.main, [str(broken), str(tmp_path / "out.safetensors")], capsys)
    assert status == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {broken}: not a readable checkpoint"), lines


def test_missing_checkpoint_is_exit_status_2(tmp_path, capsys, tiny_config):
    missing = tmp_path / "nope.ckpt"
    status, lines = exit_of(
        txt2img.main, ["--ckpt", str(missing), "--config", str(tiny_config)], capsys
    )
    assert (status, len(lines)) == (2, 1) and str(missing) in lines[0], lines


BAD_FLAGS = [
    (["--steps", "0"], "--steps"),  # sampled nothing: every image was the starting noise
    (["--n-samples", "0"], "--n-samples"),  # a traceback from torch.stack
    (["--n_iter", "0"], "--n_iter"),  # the old spelling too
    (["--H", "-32"], "--H"),  # a traceback: negative dimension
    (["--W", "0"], "--W"),  # silently the default size
    (["--scale", "nan"], "--scale"),  # every image NaN
]


@pytest.mark.parametrize("flags, flag", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
@pytest.mark.parametrize("script", [txt2img, img2img], ids=lambda s: s.__name__)
def test_a_count_size_or_scale_that_cannot_sample_is_one_line(
    tmp_path, capsys, weights, tiny_config, script, flags, flag
):
    argv = generation_argv(script, tmp_path, weights, tiny_config) + flags
    status, lines = exit_of(script.main, argv, capsys)
    assert status == 2
    assert f"error: argument {flag}" in lines[-1], lines  # argparse: usage, then its line
    assert not (tmp_path / "out").exists()


def test_a_config_without_a_model_section_is_one_line(tmp_path, capsys, weights):
    trainer_only = tmp_path / "run-lightning.yaml"
    trainer_only.write_text("lightning:\n  trainer:\n    max_steps: 2\n")
    argv = ["--ckpt", str(weights), "--config", str(trainer_only), "--steps", "1"]
    status, lines = exit_of(txt2img.main, argv, capsys)
    assert (status, len(lines)) == (2, 1), lines
    assert str(trainer_only) in lines[0] and "no model section" in lines[0], lines


# --- a full disk while writing the output ------------------------------------------------------


class FullDiskFile:
    """A file on a disk that fills up after `room` bytes: write() raises ENOSPC as the OS does."""

    def __init__(self, path, mode="r", *args, **kwargs):
        self.file = open(path, mode, *args, **kwargs)  # noqa: SIM115 (closed in close())
        self.room = 4096

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, NO_SPACE)
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_full_disk_writing_a_ckpt(tmp_path, capsys, weights, monkeypatch):
    """torch.save alone would say "[enforce fail at inline_container.cc] unexpected pos"."""
    monkeypatch.setattr(convert, "open", FullDiskFile, raising=False)
    out = tmp_path / "out.ckpt"
    status, lines = exit_of(convert.main, [str(weights), str(out)], capsys)
    assert status == 1
    assert lines == [f"error: {NO_SPACE} ({out})"]
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_full_disk_writing_safetensors(tmp_path, capsys, weights, monkeypatch):
    monkeypatch.setattr(checkpoint, "open", FullDiskFile, raising=False)
    out = tmp_path / "out.safetensors"
    status, lines = exit_of(convert.main, [str(weights), str(out)], capsys)
    assert status == 1
    assert lines == [f"error: {NO_SPACE} ({out})"]
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_full_disk_writing_a_png(tmp_path, capsys, weights, tiny_config, monkeypatch):
    def save(image, fp, *args, **kwargs):  # what PIL raises on a full disk: no file name
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(Image.Image, "save", save)
    argv = generation_argv(txt2img, tmp_path, weights, tiny_config)
    status, lines = exit_of(txt2img.main, argv, capsys)
    assert status == 1
    assert lines == [f"error: {NO_SPACE} ({tmp_path / 'out' / 'samples' / '00000.png'})"], lines


# --- as users run them: a process, its exit status, its stderr -------------------------------


@pytest.mark.slow
def test_the_process_exits_2_with_one_line_and_no_traceback(tmp_path, weights):
    """The exit status of ScriptError is the process's (the in-process tests check `.code`)."""
    broken = truncated(weights, tmp_path / "model.safetensors")
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "convert.py"),
            str(broken),
            str(tmp_path / "a.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"error: {broken}: not a readable .safetensors file (Error while deserializing header: "
        "incomplete metadata, file not fully covered)"
    ]
