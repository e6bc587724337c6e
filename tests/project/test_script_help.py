"""`--help` of the user scripts: exit 0, every option's default shown, answered without importing
torch (the rule that makes it take a fraction of a second instead of 10 s: heavy modules are
imported after the arguments are parsed). Old underscore spellings still parse."""

import argparse
import json
import subprocess
import sys

import pytest
from run_helpers import ROOT

from lun.cli import HelpFormatter
from lun.generation_args import add_generation_args

# benchmark_gpu runs on a GPU machine, where torch is what it is about; its row functions are
# typed with torch and its StepTimer subclasses Lightning's Callback (--help imports torch).
NOT_CHECKED = {"benchmark_gpu"}
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem not in NOT_CHECKED)
COMMANDS = {"lora": ["merge"]}  # `lora.py merge --help`: the options are the command's
# Runs each script as `python scripts/X.py --help` does, all in one process, and says what each
# printed and whether it imported torch (after one has, the later ones cannot be told apart).
PROBE = """
import contextlib, io, json, runpy, sys
folder, commands = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, folder)
found = {}
for name in sys.argv[3:]:
    out, code, before = io.StringIO(), None, "torch" in sys.modules
    sys.argv = [f"{folder}/{name}.py", *commands.get(name, []), "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    torch = "already imported by an earlier script" if before else "torch" in sys.modules
    found[name] = {"code": code, "torch": torch, "help": out.getvalue()}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "scripts"), json.dumps(COMMANDS), *SCRIPTS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_and_shows_defaults_without_importing_torch(helps, name):
    found = helps[name]
    assert found["code"] == 0
    assert found["help"].startswith("usage:")
    assert "(default: " in found["help"]  # every script has an option with a default
    assert found["torch"] is False, f"{name} --help: torch {found['torch'] or 'imported'}"


def test_help_shows_every_default():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_generation_args(parser)
    text = " ".join(parser.format_help().split())
    # Written out here (not read from the parser): the documented defaults, each on its flag.
    for flag, default in [("--steps", 50), ("--scale", 7.5), ("--eta", 0.0), ("--seed", 42)]:
        assert f"{flag} {flag[2:].upper()} " in text, flag
        entry = text.split(f"{flag} {flag[2:].upper()} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in entry, (flag, entry)
    assert "(default: outputs/txt2img-samples)" in text
    # An option with no help text of its own still says its default (many benchmark flags).
    bare = argparse.ArgumentParser(formatter_class=HelpFormatter)
    bare.add_argument("--warmup", type=int, default=2)
    bare.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    bare.add_argument("--verbose", action="store_true")
    text = " ".join(bare.format_help().split())
    assert "--warmup WARMUP (default: 2)" in text
    assert "(default: [0, 2])" in text
    assert "--verbose (default" not in text
    assert "(default: False)" not in text  # switches are off unless given: nothing to say


def test_dashed_flags_and_their_old_underscore_spellings_parse_alike():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_generation_args(parser)
    new = ["--ckpt", "m.ckpt", "--n-samples", "3", "--n-iter", "2", "--fixed-code", "--skip-grid"]
    old = ["--ckpt", "m.ckpt", "--n_samples", "3", "--n_iter", "2", "--fixed_code", "--skip_grid"]
    assert vars(parser.parse_args(new)) == vars(parser.parse_args(old))
    args = parser.parse_args([*old, "--ddim_steps", "7", "--ddim_eta", "0.5"])
    assert (args.n_samples, args.n_iter, args.fixed_code, args.skip_grid) == (3, 2, True, True)
    assert (args.steps, args.eta) == (7, 0.5)
    help_text = parser.format_help()
    assert "--n-samples" in help_text and "--n_samples" not in help_text  # hidden aliases
    defaults = parser.parse_args(["--ckpt", "m.ckpt"])
    assert (defaults.n_samples, defaults.steps, defaults.skip_grid) == (1, 50, False)
