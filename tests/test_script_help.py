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

SCRIPTS = ["txt2img", "img2img", "swap_vae", "cache_latents"]
# Runs the script as `python scripts/X.py --help` does, then says what got imported.
PROBE = """
import runpy, sys, json
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_without_importing_torch(name):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "scripts" / f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == {"code": 0, "torch": False}, result.stderr[-2000:]
    assert "usage:" in result.stdout


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
