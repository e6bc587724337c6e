"""Stopped, crashed and preempted runs through the launcher, as a user meets them: the exit status
of a stopped run, which checkpoint `--resume <run>` continues from, and what a killed writer or an
early signal leaves behind."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from run_helpers import ROOT, run_main

from lun.callbacks.signals import exit_status
from lun.run import newest_checkpoint

TESTS = os.pathsep.join(
    [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]
)  # callbacks defined here


class SendSignal(Callback):
    """At the end of the batch of step `at_step` send this process `signal_name`; at the start of
    training write the step it starts from to `record_start_to`; `fail_in_setup`: fail in set-up,
    before the checkpoint is restored."""

    def __init__(
        self, at_step=None, signal_name="SIGINT", record_start_to=None, fail_in_setup=False
    ):
        self.at_step, self.signum = at_step, getattr(signal, signal_name)
        self.record_start_to, self.fail_in_setup = record_start_to, fail_in_setup

    def setup(self, trainer, pl_module, stage):
        if self.fail_in_setup:
            raise RuntimeError("injected failure before the first step")

    def on_train_start(self, trainer, pl_module):
        if self.record_start_to:
            Path(self.record_start_to).write_text(str(trainer.global_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def send_signal(**params) -> str:
    items = ", ".join(f"{k}: {v}" for k, v in params.items())
    return f"lightning.callbacks.fault={{target: test_signals.SendSignal, params: {{{items}}}}}"


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_main(args, cwd=cwd, env={**os.environ, "PYTHONPATH": TESTS})


def train_args(tiny_config, shapes_dir, logs: Path, *more: str) -> list[str]:
    return [
        "--base",
        str(tiny_config),
        f"data.params.train.params.data_root={shapes_dir}",
        "-l",
        str(logs),
        "-t",
        *more,
    ]


def only_run_folder(logs: Path) -> Path:
    (run,) = list(logs.iterdir())
    return run


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def test_exit_status_of_a_stopped_fit():
    """What Lightning raises out of `fit`: a bare SIGTERMException (status 0) on SIGTERM,
    `sys.exit(1)` while handling KeyboardInterrupt on Ctrl-C."""
    assert exit_status(SIGTERMException()) == 143
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            sys.exit(1)  # as Lightning's _call_and_handle_interrupt does
    except SystemExit as stop:
        assert exit_status(stop) == 130
    assert exit_status(SystemExit(3)) is None


@pytest.mark.slow
def test_sigterm_writes_on_exception_checkpoint_and_exits_143(tmp_path, tiny_config, shapes_dir):
    logs = tmp_path / "logs"
    args = train_args(
        tiny_config,
        shapes_dir,
        logs,
        "lightning.trainer.max_steps=6",
        send_signal(at_step=2, signal_name="SIGTERM"),
    )
    result = launch(args, tmp_path)
    assert result.returncode == 143, result.stderr[-3000:]
    checkpoints = only_run_folder(logs) / "checkpoints"
    assert step_of(checkpoints / "on_exception.ckpt") == 2  # stopped there, not at max_steps
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_after_the_last_periodic_save_resumes_from_on_exception(
    tmp_path, tiny_config, shapes_dir
):
    logs = tmp_path / "logs"
    args = train_args(
        tiny_config,
        shapes_dir,
        logs,
        "lightning.trainer.max_steps=5",
        "lightning.callbacks.modelcheckpoint.params.every_n_train_steps=2",
        send_signal(at_step=3, signal_name="SIGINT"),
    )
    stopped = launch(args, tmp_path)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    run = only_run_folder(logs)
    checkpoints = run / "checkpoints"
    assert step_of(checkpoints / "last.ckpt") == 2  # the periodic save, older than the stop
    assert step_of(checkpoints / "on_exception.ckpt") == 3

    # A resume that fails before its first step leaves that checkpoint as it was.
    params = "lightning.callbacks.fault.params={at_step: null, fail_in_setup: true}"
    failed = launch(["-r", str(run), "-t", params], tmp_path)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "injected failure before the first step" in failed.stderr
    assert step_of(checkpoints / "on_exception.ckpt") == 3

    started = tmp_path / "started_at"
    params = (
        f"lightning.callbacks.fault.params={{fail_in_setup: false, record_start_to: {started}}}"
    )
    resumed = launch(["-r", str(run), "-t", params], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"resuming from {checkpoints / 'on_exception.ckpt'} (step 3" in said, said[-3000:]
    assert started.read_text() == "3"  # training went on from step 3, not from step 2
    assert step_of(checkpoints / "last.ckpt") == 5


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_config, shapes_dir) -> Path:
    """A 4-step run with a checkpoint every 2 steps (`every-2-steps.ckpt`, `step-*.ckpt`) and
    `last.ckpt` linked to the newest; tests work on copies."""
    logs = tmp_path_factory.mktemp("logs")
    args = train_args(
        tiny_config,
        shapes_dir,
        logs,
        "lightning.trainer.max_steps=4",
        "lightning.callbacks.modelcheckpoint.params.every_n_train_steps=2",
        "lightning.callbacks.metrics_over_trainsteps_checkpoint.params.every_n_train_steps=2",
    )
    result = launch(args, logs)
    assert result.returncode == 0, result.stderr[-3000:]
    run = only_run_folder(logs)
    assert (run / "checkpoints" / "last.ckpt").is_symlink()
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "logs" / run.name
    shutil.copytree(run, copy, symlinks=True)
    return copy


@pytest.mark.slow
def test_resume_without_last_ckpt_takes_the_newest_complete_checkpoint(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    checkpoints = run / "checkpoints"
    # A death between removing last.ckpt and linking it again, and a truncated file that is not
    # a checkpoint although its name says step 9.
    (checkpoints / "last.ckpt").unlink()
    whole = (checkpoints / "step-000000004.ckpt").read_bytes()
    (checkpoints / "step-000000009.ckpt").write_bytes(whole[: len(whole) // 2])

    started = tmp_path / "started_at"
    result = launch(
        [
            "-r",
            str(run),
            "-t",
            "lightning.trainer.max_steps=6",
            send_signal(record_start_to=started),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    pattern = rf"resuming from {re.escape(str(checkpoints))}/(every-2-steps|step-000000004)\.ckpt \(step 4"
    assert re.search(pattern, said), said[-3000:]
    assert f"skipped {checkpoints / 'step-000000009.ckpt'}" in said
    assert started.read_text() == "4"
    assert step_of(checkpoints / "last.ckpt") == 6


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.slow
def test_stale_temporaries_are_removed_when_a_run_resumes(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    checkpoints = run / "checkpoints"
    killed = checkpoints / f".x.ckpt.tmp-{dead_pid()}-deadbeef"  # its writer is gone
    writing = checkpoints / f".y.ckpt.tmp-{os.getpid()}-cafebabe"  # its writer is alive
    old_folder = checkpoints / ".z.ckpt.tmp-0badcafe"  # a folder (DeepSpeed), untouched for 2 h
    new_folder = checkpoints / ".w.ckpt.tmp-0dd0beef"  # one being written now
    not_ours = checkpoints / ".notes.tmp"
    for path in (killed, writing, not_ours):
        path.write_bytes(b"half a checkpoint")
    for folder in (old_folder, new_folder):
        (folder / "checkpoint").mkdir(parents=True)
        (folder / "checkpoint" / "shard.pt").write_bytes(b"half a shard")
    two_hours_ago = time.time() - 7200
    for path in (old_folder, old_folder / "checkpoint", old_folder / "checkpoint" / "shard.pt"):
        os.utime(path, (two_hours_ago, two_hours_ago))

    # -t: the run folder is set up, then one more step (without -t a check touches nothing:
    # tests/e2e/test_quiet_run.py; at its max_steps the resume is refused before the folder)
    _, step = newest_checkpoint(checkpoints)
    result = launch(["-r", str(run), f"lightning.trainer.max_steps={step + 1}", "-t"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not killed.exists() and not old_folder.exists()
    assert writing.exists() and new_folder.exists() and not_ours.exists()
    assert f"removed {killed}" in result.stderr


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: SigCgt in /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_sigusr1_during_start_up_saves_after_the_first_step(tmp_path, tiny_config, shapes_dir):
    logs = tmp_path / "logs"
    args = train_args(
        tiny_config,
        shapes_dir,
        logs,
        "lightning.trainer.max_steps=3",
        "lightning.callbacks.modelcheckpoint=null",
        "lightning.callbacks.metrics_over_trainsteps_checkpoint=null",
    )
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Sent as soon as the launcher can take it: while it still imports and builds (the run
        # folder, made just before fit, is not there yet).
        deadline = time.monotonic() + 120
        while not catches(process.pid, signal.SIGUSR1):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "SIGUSR1 never got a handler"
            time.sleep(0.002)
        assert not logs.exists() or not any(logs.iterdir()), "SIGUSR1 is only caught once fit runs"
        process.send_signal(signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    assert "SIGUSR1 came during start-up" in stdout + stderr
    # Saved after the first step (the only writer of last.ckpt here), and training went on.
    assert step_of(only_run_folder(logs) / "checkpoints" / "last.ckpt") == 1
    assert "max_steps=3` reached" in stdout + stderr
