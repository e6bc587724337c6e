"""The launcher end to end: config errors, run folder, resume, crash and signal checkpoints."""

import inspect
import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, load_main, run_main, run_main_here, start_main

from lun.data import DataModule


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
    result = run_main_here(["--base", tiny_config, *fill, *args, "-l", tmp_path], cwd=tmp_path)
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


def first_run_launch(tmp_path: Path, tiny_config: Path, shapes_dir: Path) -> list[str]:
    """A named 2-step run of the tiny config."""
    args = ["--base", str(tiny_config), data_root(shapes_dir), "-l", str(tmp_path / "logs")]
    return [*args, "-n", "demo", "-f", "_x", "-t"]


def fault(**params) -> list[str]:
    items = ", ".join(f"{k}: {v}" for k, v in params.items())
    return [
        f"lightning.callbacks.fault={{target: fault_injection.FaultInjection, params: {{{items}}}}}"
    ]


def exception_launch(tmp_path: Path, tiny_config: Path, shapes_dir: Path) -> list[str]:
    """A 5-step run that raises at step 2."""
    args = ["--base", str(tiny_config), data_root(shapes_dir), "-l", str(tmp_path / "logs")]
    return [*args, "-t", "lightning.trainer.max_steps=5", *fault(raise_at_step=2)]


def sigusr1_launch(tmp_path: Path, tiny_config: Path, shapes_dir: Path) -> list[str]:
    """A 3-step run without periodic checkpoints that gets SIGUSR1 at step 1."""
    args = ["--base", str(tiny_config), data_root(shapes_dir), "-l", str(tmp_path / "logs")]
    args += ["-t", "lightning.trainer.max_steps=3", "lightning.callbacks.modelcheckpoint=null"]
    args += ["lightning.callbacks.metrics_over_trainsteps_checkpoint=null"]
    return [*args, *fault(signal_at_step=1)]


LAUNCHES = {
    "test_train_writes_the_run_folder_and_resume_continues": first_run_launch,
    "test_exception_writes_on_exception_checkpoint": exception_launch,
    "test_sigusr1_saves_last_and_training_goes_on": sigusr1_launch,
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory, tiny_config, shapes_dir):
    """The launch (`LAUNCHES`) of each test of this module that this session runs, started at
    once: on 2 cores they go side by side instead of one after the other. test name -> (its
    folder, its process)"""
    wanted = [
        item.originalname
        for item in request.session.items
        if item.module is request.module and item.originalname in LAUNCHES
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # fault_injection
    runs = {}
    for name in wanted:
        tmp_path = tmp_path_factory.mktemp(name[5:40])
        args = LAUNCHES[name](tmp_path, tiny_config, shapes_dir)
        runs[name] = (tmp_path, start_main(args, tmp_path, tmp_path / "stderr.txt", env=env))
    yield runs
    for _, process in runs.values():  # a test that failed first leaves no run going
        process.kill()
        process.wait()


def finished(launched: dict, name: str) -> tuple[Path, int, str]:
    """(the folder, the exit status, the stderr) of the test `name`'s launch."""
    tmp_path, process = launched[name]
    returncode = process.wait(timeout=300)
    return tmp_path, returncode, (tmp_path / "stderr.txt").read_text()


@pytest.mark.slow
def test_train_writes_the_run_folder_and_resume_continues(launched):
    tmp_path, returncode, stderr = finished(
        launched, "test_train_writes_the_run_folder_and_resume_continues"
    )
    assert returncode == 0, stderr[-3000:]
    logs = tmp_path / "logs"
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
    assert "exists and is not empty" not in second.stderr  # Lightning's, about our own folder
    resumed = load(run / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 4
    # The optimizer continued: AdamW counted 4 steps, not 2 from a fresh start.
    (state,) = resumed["optimizer_states"]
    assert all(int(s["step"]) == 4 for s in state["state"].values())


@pytest.mark.slow
def test_exception_writes_on_exception_checkpoint(launched):
    tmp_path, returncode, stderr = finished(
        launched, "test_exception_writes_on_exception_checkpoint"
    )
    assert returncode != 0
    assert "injected failure at step 2" in stderr
    ckpt = only_run_folder(tmp_path / "logs") / "checkpoints" / "on_exception.ckpt"
    assert load(ckpt)["global_step"] == 2


@pytest.mark.slow
def test_sigusr1_saves_last_and_training_goes_on(launched):
    tmp_path, returncode, stderr = finished(
        launched, "test_sigusr1_saves_last_and_training_goes_on"
    )
    assert returncode == 0, stderr[-3000:]
    assert "max_steps=3` reached" in stderr
    checkpoints = only_run_folder(tmp_path / "logs") / "checkpoints"
    assert (
        load(checkpoints / "last.ckpt")["global_step"] == 1
    )  # written at the signal, not at the end
    assert not (checkpoints / "on_exception.ckpt").exists()


# --- --scale_lr: the learning rate the model is built with --------------------------------------


@pytest.fixture
def launch_in_process(monkeypatch, tmp_path):
    """main.main(argv) with Trainer.fit stubbed: returns (exit status, the model fit was given,
    the learning rate of the optimizer that model builds)."""
    from lightning.pytorch import Trainer

    seen = {}

    def fit(trainer, model, *args, **kwargs):
        optimizer = model.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        seen.update(model=model, optimizer_lr=optimizer.param_groups[0]["lr"])

    monkeypatch.setattr(Trainer, "fit", fit)
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything's; restored afterwards
        monkeypatch.delenv(name, raising=False)
    loggers = [logging.getLogger(name) for name in ("ldm", "lun")]
    saved = [(log, list(log.handlers), log.level) for log in loggers]
    main = load_main()

    def launch(config: Path, *args: str):
        status = main.main(["--base", str(config), *args, "-l", str(tmp_path / "logs"), "-t"])
        return status, seen.get("model"), seen.get("optimizer_lr")

    yield launch
    for log, handlers, level in saved:  # main adds its handler on every call
        log.handlers[:] = handlers
        log.setLevel(level)


def tiny_with_batch_sizes(tmp_path: Path, tiny_config: Path, top, train) -> Path:
    """The tiny config with `data.params.batch_size` = top and `data.params.train.batch_size` =
    train (None: not set at all)."""
    cfg = OmegaConf.load(tiny_config)
    del cfg.data.params["batch_size"]
    if top is not None:
        cfg.data.params.batch_size = top
    if train is not None:
        cfg.data.params.train.batch_size = train
    path = tmp_path / "batch.yaml"
    OmegaConf.save(cfg, path)
    return path


DATAMODULE_DEFAULT_BATCH = inspect.signature(DataModule).parameters["batch_size"].default


@pytest.mark.parametrize(
    "top, train, batch",
    [
        (None, 3, 3),  # only the split's own batch size
        (2, None, 2),  # the default of every split
        (2, 3, 3),  # the split's own wins over the default
        (None, None, DATAMODULE_DEFAULT_BATCH),  # neither: the DataModule's default
    ],
    ids=["split", "default", "split_over_default", "datamodule_default"],
)
def test_scale_lr_multiplies_by_the_train_batch_size(
    tmp_path, tiny_config, shapes_dir, launch_in_process, capsys, top, train, batch
):
    config = tiny_with_batch_sizes(tmp_path, tiny_config, top, train)
    base_lr = OmegaConf.load(tiny_config).model.base_learning_rate
    status, model, optimizer_lr = launch_in_process(
        config,
        data_root(shapes_dir),
        "--scale_lr",
        "lightning.trainer.accumulate_grad_batches=2",
        "lightning.trainer.devices=2",
        "lightning.trainer.num_nodes=3",
    )
    assert status == 0, capsys.readouterr().err[-3000:]
    expected = 2 * 2 * 3 * batch * base_lr  # accumulate x devices x nodes x batch x base
    assert model.learning_rate == pytest.approx(expected, rel=1e-12)
    assert optimizer_lr == pytest.approx(expected, rel=1e-12)  # what the optimizer steps with
    assert f"{batch} (batch size)" in capsys.readouterr().out


def test_without_scale_lr_the_model_gets_base_learning_rate(
    tmp_path, tiny_config, shapes_dir, launch_in_process
):
    status, model, optimizer_lr = launch_in_process(
        tiny_config,
        data_root(shapes_dir),
        "model.base_learning_rate=3.0e-5",
        "lightning.trainer.devices=2",
    )
    assert status == 0
    assert model.learning_rate == optimizer_lr == 3.0e-5


@pytest.mark.parametrize(
    "base_lr, message",
    [
        ("absent", "--scale_lr needs model.base_learning_rate"),
        (None, "--scale_lr needs model.base_learning_rate"),  # null means unset
        (-1.0e-4, "model.base_learning_rate: -0.0001 is not a positive number"),
        ("fast", "model.base_learning_rate: 'fast' is not a positive number"),
    ],
    ids=["absent", "null", "negative", "string"],
)
def test_scale_lr_without_a_usable_base_learning_rate_is_a_config_error(
    tmp_path, tiny_config, shapes_dir, launch_in_process, capsys, base_lr, message
):
    cfg = OmegaConf.load(tiny_config)
    if base_lr == "absent":
        del cfg.model["base_learning_rate"]
    else:
        cfg.model.base_learning_rate = base_lr
    config = tmp_path / "base-lr.yaml"
    OmegaConf.save(cfg, config)
    status, model, _ = launch_in_process(config, data_root(shapes_dir), "--scale_lr")
    assert status == 2 and model is None
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
