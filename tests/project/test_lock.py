"""The lock: every dependency pinned, the environment the suite runs in is the locked one, and
`make setup` installs through it (so a new release on PyPI cannot turn a fresh clone red)."""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402

LOCK_FILE = Path(os.environ.get("LUN_LOCK_FILE", ROOT / "requirements-lock.txt"))
REQUIREMENT_FILES = [
    "requirements.txt",
    "requirements-dev.txt",
    "requirements-vocab.txt",
    "requirements-lpips.txt",
]


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.append(lock.normalise(re.split(r"[\[<>=!~; ]", line, maxsplit=1)[0]))
    return names


@pytest.mark.parametrize("path", REQUIREMENT_FILES)
def test_every_requirement_is_pinned_in_the_lock(path):
    pins = lock.read_pins(LOCK_FILE)
    missing = [n for n in requirement_names(path) if n not in pins and n not in lock.NOT_LOCKED]
    assert not missing, f"{path}: {missing} not in {LOCK_FILE.name}; run `make lock`"


def test_the_suite_runs_on_the_locked_versions():
    """A red run on a fresh clone should never be a surprise release: what is installed is what
    the lock says (set LOCK= in `make setup` and this test tells you you are off the lock)."""
    off = []
    for name, version in lock.read_pins(LOCK_FILE).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            off.append(f"{name}: locked {version}, not installed")
            continue
        if installed != version:
            off.append(f"{name}: locked {version}, installed {installed}")
    assert not off, "; ".join(off)


def test_torch_is_pinned_by_the_makefile_and_not_the_lock():
    assert "torch" not in lock.read_pins(LOCK_FILE)
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION := (\S+)$", makefile, re.M).group(1)
    assert importlib.metadata.version("torch").split("+")[0] == version


def test_make_setup_installs_through_the_lock():
    out = subprocess.run(
        ["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    installs = [line for line in out.splitlines() if "-r requirements" in line]
    assert installs and all("-c requirements-lock.txt" in line for line in installs), out
    unlocked = subprocess.run(
        ["make", "-n", "-B", "setup", "LOCK="], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert "-c requirements-lock.txt" not in unlocked


def test_moved_names_each_package_that_changed(tmp_path):
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("# header\nPeft==0.21.2\ntransformers==5.23.0\nsix==1.16.0\n")
    new.write_text("peft==0.21.2\ntransformers==5.24.0\nkernels==0.11.1\n")
    assert lock.moved(lock.read_pins(old), lock.read_pins(new)) == [
        "kernels: - -> 0.11.1",
        "six: 1.16.0 -> -",
        "transformers: 5.23.0 -> 5.24.0",
    ]


def test_lock_text_keeps_the_header_and_drops_torch_and_the_project():
    text = lock.lock_text("torch==2.13.0+cpu\nZlib-x==1.0\n-e git+x#egg=lun\nabc==2\n")
    lines = text.splitlines()
    assert lines[0].startswith("#")
    assert [line for line in lines if not line.startswith("#")] == ["abc==2", "Zlib-x==1.0"]


def test_held_pins_constrain_the_requirements_and_nothing_else(tmp_path):
    held = tmp_path / "held.txt"
    steps = lock.install_steps("py", "torch==2.13.0", held)
    constrained = [step for step in steps if str(held) in step]
    assert len(constrained) == 1 and "requirements.txt" in constrained[0]
    assert constrained[0][constrained[0].index(str(held)) - 1] == "-c"
    assert not any(str(held) in " ".join(step) for step in lock.install_steps("py", "t", None))


def test_a_hold_that_is_not_a_pin_or_not_in_the_result_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lock.main(["--hold", "transformers"])
    assert exit_info.value.code == 2
    assert "--hold transformers: give an exact pin" in capsys.readouterr().err
    pins = {"transformers": "5.23.0", "peft": "0.21.2"}
    assert lock.not_held(["Transformers==5.23.0"], pins) == []
    assert lock.not_held(["tranformers==5.23.0", "peft==0.22.0"], pins) == [
        "tranformers==5.23.0",
        "peft==0.22.0",
    ]
