"""Every bad config value is one line naming its key, exit status 2, and no run folder.

Values that Lightning, the loaders or the datasets would only check inside `fit` (a traceback, a
new run folder and a step-0 `on_exception.ckpt`) are checked by the launcher before it creates
the run folder. Each case runs the launcher's `main()` in a process of its own; to pay the heavy
imports (Lightning, torch, transformers) once instead of once per case, the cases are forked from
one process that has imported them (`test_the_real_command_line_agrees` runs `python main.py`).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from run_helpers import ROOT, run_main

from lun.config import ConfigError, config_errors, load_yaml

ROOT_DATA = "data.params.train.params.data_root"
TRAIN = "data.params.train.params"
UNET = "model.params.unet_config.params"

# (case id, overrides after the tiny config, text the one error line must hold)
CASES = [
    ("max_steps=-5", ["lightning.trainer.max_steps=-5"], "lightning.trainer.max_steps=-5: expected a whole number >= 1 or -1"),
    ("max_steps=0", ["lightning.trainer.max_steps=0"], "lightning.trainer.max_steps=0: expected a whole number >= 1 or -1 for no limit"),
    ("max_epochs=0", ["lightning.trainer.max_epochs=0"], "lightning.trainer.max_epochs=0: expected a whole number >= 1"),
    ("name-a-path", ["-n", "a/b"], "-n/--name, --postfix: 'a/b' holds a '/'; a run's name is one folder name"),
    ("max_steps=abc", ["lightning.trainer.max_steps=abc"], "lightning.trainer.max_steps='abc': expected a whole number"),
    ("max_epochs=-3", ["lightning.trainer.max_epochs=-3"], "lightning.trainer.max_epochs=-3: expected"),
    ("accumulate=0", ["lightning.trainer.accumulate_grad_batches=0"], "lightning.trainer.accumulate_grad_batches=0: expected a whole number >= 1"),
    ("accelerator=gpu", ["lightning.trainer.accelerator=gpu"], "lightning.trainer.accelerator='gpu': not available on this machine"),
    ("data_root=", [f"{ROOT_DATA}="], f"{ROOT_DATA}=None: expected the dataset's folder"),
    ("data_root=''", [f"{ROOT_DATA}=''"], f"{ROOT_DATA}='': expected the dataset's folder"),
    ("data_root absent", [f"{TRAIN}=null"], "data.params.train: lun.data.local.Local: missing a required argument: 'data_root'"),
    ("data_root nonexistent", [f"{ROOT_DATA}={{tmp}}/nope"], f"{ROOT_DATA}='{{tmp}}/nope' does not exist"),
    ("data_root a file", [f"{ROOT_DATA}={{tmp}}/file.txt"], f"{ROOT_DATA}='{{tmp}}/file.txt' is not a folder"),
    ("data_root empty", [f"{ROOT_DATA}={{tmp}}/empty"], f"{ROOT_DATA}='{{tmp}}/empty' has no usable items: found no files at all"),
    ("no image at all", [f"{ROOT_DATA}={{tmp}}/texts"], f"{ROOT_DATA}='{{tmp}}/texts' has no usable items: found 2 .txt"),
    ("no readable image", [f"{ROOT_DATA}={{tmp}}/garbage"], f"{ROOT_DATA}='{{tmp}}/garbage' has no usable image: the first 3 cannot be read"),
    ("batch_size=-1", ["data.params.batch_size=-1"], "data.params.batch_size=-1: expected a whole number >= 1"),
    ("batch_size=0", ["data.params.batch_size=0"], "data.params.batch_size=0: expected a whole number >= 1"),
    ("batch_size=abc", ["data.params.batch_size=abc"], "data.params.batch_size='abc': expected a whole number"),
    ("train batch_size=0", ["data.params.train.batch_size=0"], "data.params.train.batch_size=0: expected a whole number >= 1"),
    ("train batch_sise", ["data.params.train.batch_sise=4"], "data.params.train.batch_sise: not a loader setting"),
    ("num_workers=-1", ["data.params.num_workers=-1"], "data.params.num_workers=-1: expected a whole number >= 0"),
    ("flip_p=2", [f"{TRAIN}.flip_p=2"], f"{TRAIN}.flip_p=2: expected a probability in [0, 1]"),
    ("size=0", [f"{TRAIN}.size=0"], f"{TRAIN}.size=0: expected a whole number >= 1"),
    ("size cannot fit", [f"{TRAIN}.size=30"], f"{TRAIN}.size=30: height and width must be multiples of 4 for this model"),
    ("flow shift=abc", ["model.params.parameterization=flow", "model.params.schedule.shift=abc"], "model.params.schedule.shift must be a number, got 'abc'"),
    ("optimizer target", ["model.params.optimizer_config.target=adamw9"], "model.params.optimizer_config.target='adamw9': expected adamw or adamw8bit"),
    ("optimizer package", ["model.params.optimizer_config.target=nopackage.Adam"], "model.params.optimizer_config: optimizer 'nopackage.Adam' needs the package 'nopackage': pip install nopackage"),
    ("ckpt_path a folder", ["model.params.ckpt_path={tmp}/empty"], "model.params.ckpt_path: {tmp}/empty is a folder; expected a weights file"),
    ("base_lr=abc", ["model.base_learning_rate=abc"], "model.base_learning_rate: 'abc' is not a positive number"),
    ("base_lr=-1", ["model.base_learning_rate=-1e-4"], "model.base_learning_rate: -0.0001 is not a positive number"),
    ("model_channels=20", [f"{UNET}.model_channels=20"], f"{UNET}.model_channels=20: expected a multiple of 32"),
    ("model.target=module", ["model.target=ldm.util"], "model.target: 'ldm.util' is a module; expected a LightningModule class"),
    ("model.target=class", ["model.target=ldm.unet.UNetModel"], "model.target: 'ldm.unet.UNetModel' is the class UNetModel; expected a LightningModule class"),
    ("data.target=class", ["data.target=lun.data.local.Local"], "data.target: 'lun.data.local.Local' is the class Local; expected a LightningDataModule class"),
    ("strategy target", ["lightning.strategy={target: lun.nothing.Here}"], "lightning.strategy: target 'lun.nothing.Here': no module 'lun.nothing'"),
    ("callback target", ["lightning.callbacks.extra={target: lun.nothing.Here}"], "lightning.callbacks.extra: target 'lun.nothing.Here': no module 'lun.nothing'"),
]  # fmt: skip
GPU = torch.cuda.is_available() or torch.backends.mps.is_available()
CASES = [case for case in CASES if not (GPU and case[0] == "accelerator=gpu")]

RUNNER = textwrap.dedent(
    """
    import importlib.util, json, os, sys, traceback

    root, cases_file, results_file = sys.argv[1:]
    sys.path.insert(0, root)  # as `python main.py` has it
    spec = importlib.util.spec_from_file_location("lun_main", os.path.join(root, "main.py"))
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    import lightning.pytorch, ldm.diffusion, lun.trainer  # what main.run imports, once

    results = []
    for case in json.load(open(cases_file)):
        out = os.open(case["stdout"], os.O_WRONLY | os.O_CREAT)
        err = os.open(case["stderr"], os.O_WRONLY | os.O_CREAT)
        pid = os.fork()
        if pid == 0:  # the child: `python main.py ARGV` in all that matters
            os.chdir(case["cwd"])
            os.dup2(out, 1)
            os.dup2(err, 2)
            try:
                status = main.main(case["argv"])
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        os.close(out)
        os.close(err)
        results.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    json.dump(results, open(results_file, "w"))
    """
)


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory) -> Path:
    """Folders that are no dataset: empty, text only, images that cannot be read; and a file."""
    root = tmp_path_factory.mktemp("bad_data")
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a folder")
    for name in ("a", "b"):
        (root / "texts" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "texts" / f"{name}.txt").write_text("a caption without an image")
    for name in ("a.png", "b.jpg", "c.webp"):
        (root / "garbage" / "images").mkdir(parents=True, exist_ok=True)
        (root / "garbage" / "images" / name).write_bytes(b"not an image at all")
    return root


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_config, shapes_dir, bad_data) -> dict:
    """{case id: (exit status, stderr, the case's log folder)} of every case, each launched as
    `main.py --base tiny.yaml data_root=<shapes> OVERRIDES -l <its own folder> -t`."""
    work = tmp_path_factory.mktemp("config_errors")
    cases, folders = [], {}
    for i, (case_id, overrides, _) in enumerate(CASES):
        folder = work / f"case{i}"
        folder.mkdir()
        folders[case_id] = folder
        args = [a.replace("{tmp}", str(bad_data)) for a in overrides]
        argv = ["--base", str(tiny_config), f"{ROOT_DATA}={shapes_dir}", *args]
        cases.append(
            {
                "argv": [*argv, "-l", str(folder / "logs"), "-t"],
                "cwd": str(folder),
                "stdout": str(folder / "stdout"),
                "stderr": str(folder / "stderr"),
            }
        )
    (work / "cases.json").write_text(json.dumps(cases))
    subprocess.run(
        [sys.executable, "-c", RUNNER, str(ROOT), str(work / "cases.json"), str(work / "rc.json")],
        check=True,
        timeout=600,
    )
    statuses = json.loads((work / "rc.json").read_text())
    return {
        case_id: (status, (folders[case_id] / "stderr").read_text(), folders[case_id])
        for (case_id, _, _), status in zip(CASES, statuses)
    }


def assert_one_config_error_line(status: int, stderr: str, expected: str) -> None:
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("config error")]
    assert errors == [f"config error: {expected}"] or (
        len(errors) == 1 and expected in errors[0]
    ), stderr[-3000:]
    # Nothing else on stderr reads as an error (log lines of the data indexing may be there).
    assert sum("rror" in line for line in stderr.splitlines()) == 1, stderr[-3000:]


@pytest.mark.parametrize(
    ("case_id", "expected"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_value_is_one_line_exit_2_and_no_run_folder(launched, bad_data, case_id, expected):
    status, stderr, folder = launched[case_id]
    assert_one_config_error_line(status, stderr, expected.replace("{tmp}", str(bad_data)))
    assert not (folder / "logs").exists()  # no run folder, so no checkpoint either
    assert not list(folder.rglob("*.ckpt"))


def test_the_real_command_line_agrees(tmp_path, tiny_config, shapes_dir):
    """`python main.py` itself, for a value only the dataset checks (the forked cases' twin)."""
    args = ["--base", str(tiny_config), f"{ROOT_DATA}={shapes_dir}", f"{TRAIN}.flip_p=2"]
    result = run_main([*args, "-l", str(tmp_path / "logs"), "-t"], cwd=tmp_path)
    assert_one_config_error_line(
        result.returncode, result.stderr, f"{TRAIN}.flip_p=2: expected a probability in [0, 1]"
    )
    assert not (tmp_path / "logs").exists()


def test_config_errors_names_the_full_key_and_lets_bugs_through():
    config = {"target": "x.Y", "params": {"inner": {"params": {"flip_p": 2, "size": 1}}}}
    with pytest.raises(ConfigError, match=r"^data\.params\.inner\.params\.flip_p=2: expected"):
        with config_errors("data", config):
            raise ValueError("flip_p=2: expected a probability")
    with pytest.raises(ConfigError, match=r"^data: size mismatch$"):  # not `size=`: no path
        with config_errors("data", config):
            raise ValueError("size mismatch\nsecond line")
    with pytest.raises(TypeError):  # a bug inside a constructor keeps its traceback
        with config_errors("data", config):
            raise TypeError("unsupported operand")


def test_yaml_reads_exponents_without_a_dot_as_numbers(tmp_path):
    """YAML 1.1 reads `1e-4` as text, which base_learning_rate would refuse as not a number."""
    path = tmp_path / "lr.yaml"
    path.write_text("model:\n  base_learning_rate: 1e-4\n  other: 2.5E+3\n  name: 1e-4x\n")
    model = load_yaml(path).model
    assert model.base_learning_rate == 1e-4 and model.other == 2500.0 and model.name == "1e-4x"
