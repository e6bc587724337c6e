"""A newcomer's first commands say what they do and nothing else.

- Importing our modules prints nothing, and does not import peft (whose import of bitsandbytes
  prints a line on CPUs with avx512bf16).
- A run prints our lines and the progress: the third-party messages below, which a user met on
  every run (or Ctrl-C) of the tiny config, are gone, and the memory plan is one line.
- `main.py` without `-t` checks the config and writes nothing: no run folder, a resumed run
  untouched.
"""

import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from run_helpers import ROOT, run_main, run_main_here

from lun import quiet

# What Lightning, torch and bitsandbytes printed on the tiny LoRA run stopped by Ctrl-C, before
# lun/quiet.py (issue 28), in their words.
NOISE = [
    "Failed to load CPU gemm_4bit_forward from kernels-community",  # bitsandbytes, at import
    "try installing [litlogger]",  # Lightning's tip
    "`isinstance(treespec, LeafSpec)` is deprecated",  # Lightning's use of torch's pytree
    "module(s) in eval mode at the start of training",  # our frozen VAE and text encoder
    "`weights_only` was not set",  # Lightning's on_exception save
]


def modules(package: str) -> list[str]:
    folder = ROOT / package
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in folder.rglob("*.py")
    )


# ldm.lora_fast subclasses peft's LoRA layer: it is peft, imported where adapters are made.
PEFT_MODULES = {"ldm.lora_fast"}


def test_importing_our_modules_prints_nothing_and_leaves_peft_alone():
    names = [m for m in modules("ldm") + modules("lun") if m not in PEFT_MODULES]
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({name!r})\n" for name in names)
    code += "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules), end='')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
    assert result.stdout == "[]"  # nothing printed, and neither peft nor bitsandbytes imported


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_a_tiny_lora_run_stopped_by_ctrl_c_prints_only_our_lines(tmp_path, tiny_config, shapes_dir):
    logs = tmp_path / "logs"
    ctrl_c = "lightning.callbacks.fault={target: test_signals.SendSignal, params: {at_step: 2}}"
    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={shapes_dir}"]
    args += ["model.params.lora={rank: 2}", "lightning.trainer.max_steps=4", ctrl_c]
    args += ["-l", str(logs), "-t"]
    tests = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # test_signals.SendSignal
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(tests)}
    # SIGINT as a terminal gives it, also where pytest runs in a background job (which ignores it)
    result = run_main(args, cwd=tmp_path, env=env, preexec_fn=default_sigint, timeout=900)
    assert result.returncode == 130, result.stderr[-3000:]  # stopped by SIGINT, saved
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if any(noise in line for noise in NOISE)] == []
    plan = [line for line in lines if "memory plan" in line]
    assert len(plan) == 1 and plan[0].startswith("memory plan: peak "), plan
    assert not any("= training peak" in line for line in lines)  # the table is --plan's
    assert any("LoRA: adapters on " in line for line in lines)
    assert (next(logs.iterdir()) / "checkpoints" / "on_exception.ckpt").is_file()


def test_without_t_the_config_is_checked_and_nothing_is_written(tmp_path, tiny_config, shapes_dir):
    args = ["--base", tiny_config, f"data.params.train.params.data_root={shapes_dir}"]
    result = run_main_here([*args, "-l", tmp_path / "logs"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "config checked; add -t to train"
    assert not (tmp_path / "logs").exists()


def listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.slow
def test_resume_without_t_leaves_the_run_untouched(tmp_path, trained_run):
    run = shutil.copytree(trained_run, tmp_path / "run", symlinks=True)
    before = listing(run)
    result = run_main_here(["--resume", run, "lightning.trainer.max_steps=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "config checked; add -t to train"
    assert "resuming from" not in result.stderr  # it does not
    assert f"would resume from {run / 'checkpoints'}" in result.stderr
    assert listing(run) == before  # no config appended, no folder made, nothing removed


def test_resume_with_no_step_left_is_one_line_and_leaves_the_run_untouched(tmp_path, trained_run):
    # The run trained its 2 steps: Lightning loaded the checkpoint and stopped without a word.
    run = shutil.copytree(trained_run, tmp_path / "run", symlinks=True)
    before = listing(run)
    result = run_main_here(["--resume", run, "-t"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "error" in x]
    assert "lightning.trainer.max_steps: 2, but " in line, line
    assert "is at step 2: nothing is left to train" in line, line
    assert listing(run) == before
    checked = run_main_here(["--resume", run, "lightning.trainer.max_steps=3"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr


def test_nothing_given_says_what_to_give(tmp_path):
    result = run_main_here(["-t"], cwd=tmp_path)
    assert result.returncode == 2
    assert "nothing to run: give --base CONFIG.yaml or --resume RUN" in result.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("value", ["-1", str(2**32), str(2**64)])
def test_a_seed_out_of_range_is_argparses_line(tmp_path, value):
    # -1 was a Lightning traceback ("-1 is not in bounds, numpy accepts from 0 to 4294967295").
    with pytest.raises(SystemExit) as stop:
        run_main_here(["--seed", value, "-t"], cwd=tmp_path)
    assert stop.value.code == 2


def test_help_shows_resume_with_t():
    result = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--help"], capture_output=True, text=True
    )
    resume = [line for line in result.stdout.splitlines() if "--resume logs/<run>" in line]
    assert resume and all(" -t" in line for line in resume), result.stdout


def test_only_the_known_messages_are_dropped(caplog):
    """By their text: another warning, or another message of the same logger, still shows."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn(
            "Found 138 module(s) in eval mode at the start of training. This may ...", stacklevel=1
        )
        warnings.warn("Found a problem of our own", stacklevel=1)
    assert [str(w.message) for w in seen] == ["Found a problem of our own"]
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module ...")
        bnb.warning("Failed to load something else")
    assert caplog.messages == ["Failed to load something else"]
