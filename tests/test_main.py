"""The launcher end to end: config errors, run folder, resume, crash and signal checkpoints."""

import os
from pathlib import Path

import pytest
import torch
from run_helpers import ROOT, run_main


def data_root(shapes_dir):
    return f"data.params.train.params.data_root={shapes_dir}"


def only_run_folder(logdir: Path) -> Path:
    (run,) = list(logdir.iterdir())
    return run


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "missing required value 'data.params.train.params.data_root'"),
        (
            ["model.target=ldm.diffusion.LatentDifusion"],
            "did you mean ldm.diffusion.LatentDiffusion",
        ),
        (
            ["lightning.trainer.max_step=3"],
            "lightning.trainer.max_step: not a Trainer argument; did you mean 'max_steps'",
        ),
        (["model.params.min_snr_gama=5"], "min_snr_gama"),
        (["lightning.trainer.precision=17"], "lightning.trainer"),
        (["--frobnicate"], "unknown option --frobnicate"),
    ],
)
def test_bad_config_is_one_line_and_exit_status_2(tmp_path, tiny_config, shapes_dir, args, message):
    fill = [] if not args else [data_root(shapes_dir)]
    result = run_main(["--base", str(tiny_config), *fill, *args, "-l", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  target: x\n  params: {a: 1\n")
    result = run_main(["--base", str(bad)], cwd=tmp_path)
    assert result.returncode == 2
    assert f"{bad}:4" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_writes_the_run_folder_and_resume_continues(tmp_path, tiny_config, shapes_dir):
    logs = tmp_path / "logs"
    args = [
        "--base",
        str(tiny_config),
        data_root(shapes_dir),
        "-l",
        str(logs),
        "-n",
        "demo",
        "-f",
        "_x",
        "-t",
    ]
    first = run_main(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = only_run_folder(logs)
    assert run.name.endswith("_demo_x")
    assert (run / "images").is_dir() and (run / "tensorboard").is_dir()
    assert len(list((run / "configs").glob("*-project.yaml"))) == 1
    assert len(list((run / "configs").glob("*-lightning.yaml"))) == 1
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 2

    # Resume from the folder with its saved configs, asking for 2 more steps.
    second = run_main(["-r", str(run), "lightning.trainer.max_steps=4", "-t"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert only_run_folder(logs) == run  # same folder, no new run
    resumed = load(run / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 4
    # The optimizer continued: AdamW counted 4 steps, not 2 from a fresh start.
    (state,) = resumed["optimizer_states"]
    assert all(int(s["step"]) == 4 for s in state["state"].values())


def fault(tmp_path, **params) -> list[str]:
    items = ", ".join(f"{k}: {v}" for k, v in params.items())
    return [
        f"lightning.callbacks.fault={{target: fault_injection.FaultInjection, params: {{{items}}}}}"
    ]


@pytest.mark.slow
def test_exception_writes_on_exception_checkpoint(tmp_path, tiny_config, shapes_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    args = [
        "--base",
        str(tiny_config),
        data_root(shapes_dir),
        "-l",
        str(tmp_path),
        "-t",
        "lightning.trainer.max_steps=5",
        *fault(tmp_path, raise_at_step=2),
    ]
    result = run_main(args, cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert "injected failure at step 2" in result.stderr
    ckpt = only_run_folder(tmp_path) / "checkpoints" / "on_exception.ckpt"
    assert load(ckpt)["global_step"] == 2


@pytest.mark.slow
def test_sigusr1_saves_last_and_training_goes_on(tmp_path, tiny_config, shapes_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    args = [
        "--base",
        str(tiny_config),
        data_root(shapes_dir),
        "-l",
        str(tmp_path),
        "-t",
        "lightning.trainer.max_steps=3",
        "lightning.callbacks.modelcheckpoint=null",
        "lightning.callbacks.metrics_over_trainsteps_checkpoint=null",
        *fault(tmp_path, signal_at_step=1),
    ]
    result = run_main(args, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=3` reached" in result.stderr + result.stdout
    checkpoints = only_run_folder(tmp_path) / "checkpoints"
    assert (
        load(checkpoints / "last.ckpt")["global_step"] == 1
    )  # written at the signal, not at the end
    assert not (checkpoints / "on_exception.ckpt").exists()
