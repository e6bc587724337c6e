"""Helpers the end-to-end tests share (imported by name; conftest modules cannot be)."""

import contextlib
import importlib.util
import io
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_ports(count: int) -> list[int]:
    """`count` different free ports (all held while they are asked for)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def failure_lines(stderr: str, tail: int = 3000) -> str:
    """A failed multi-process run's stderr for an assertion message: each line that says what
    went wrong (rank 0's cause often scrolls far above rank 1's last words), then the tail."""
    said = [
        line
        for line in stderr.splitlines()
        if any(word in line for word in ("Error", "Traceback", "abort", "terminate", "Signal"))
    ]
    return "\n".join(said[:40]) + "\n--- the end ---\n" + stderr[-tail:]


def with_port(port: int | None, env: dict | None = None) -> dict | None:
    """`env` (None: this environment) with MASTER_PORT set to `port` (None: `env` as it is)."""
    return {**(env or os.environ), "MASTER_PORT": str(port)} if port else env


def start_main(
    args: list[str], cwd: Path, stderr: Path, port: int | None = None, env: dict | None = None
):
    """Start `python main.py ARGS` in the background, its stderr into the file `stderr` (no pipe
    to fill while nobody reads it), with its own rendezvous port (`free_ports`) when given: runs
    launched side by side could otherwise pick the same free one. `env`: the environment (None:
    this one)."""
    with stderr.open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "main.py"), *args],
            cwd=cwd,
            env=with_port(port, env),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def run_main(
    args: list[str], cwd: Path, timeout: float = 300, **kwargs
) -> subprocess.CompletedProcess:
    """Run `python main.py ARGS` in a subprocess (how users run it)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def load_main():
    """main.py as a module, to run the launcher in this process and look at what it built."""
    spec = importlib.util.spec_from_file_location("lun_main", ROOT / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """main.py's main(ARGS) in this process, its output captured like run_main's.

    For runs that stop at a config error or only build the model: a subprocess spends seconds
    importing torch and Lightning again for each case. Runs that train stay in subprocesses (a
    run sets the global seed and threads, and a real launch is what they check).
    """
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_environ = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = load_main().main([str(a) for a in args])
    finally:
        os.chdir(old_cwd)
        # Lightning sets MASTER_ADDR/MASTER_PORT (and more) here: later subprocesses would
        # inherit one fixed port and could find it still taken.
        os.environ.clear()
        os.environ.update(old_environ)
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def train_here(args: list[str], logs: Path, cwd: Path) -> Path:
    """`main.py ARGS -l LOGS -t` in this process (`run_main_here`), which must succeed; the one
    run folder it made under `logs`."""
    result = run_main_here([*args, "-l", str(logs), "-t"], cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = list(logs.iterdir())
    return run


def refused_here(args: list[str], logs: Path, cwd: Path) -> str:
    """`main.py ARGS -l LOGS -t` in this process (`run_main_here`), which must be refused the
    way bad input is: exit status 2, no traceback, no run folder under `logs`. Its last line."""
    result = run_main_here([*args, "-l", str(logs), "-t"], cwd=cwd)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not logs.exists()
    return result.stderr.strip().splitlines()[-1]


def pretrained_base(config: Path, out: Path) -> dict:
    """A "pretrained" base for a LoRA run, saved to `out` as an original-layout checkpoint: the
    model `config` builds (seed 0) with every weight moved off its init (the UNet's zero output
    layer would pass no gradient to the adapters). Its model config, as built."""
    import torch

    from ldm.util import instantiate_from_config
    from lun.config import merge_configs, to_container

    model_config = to_container(merge_configs([config]))["model"]
    torch.manual_seed(0)
    base = instantiate_from_config(model_config)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": base.state_dict()}, out)
    return model_config


def start_demo(tmp: Path, *configs: Path) -> subprocess.Popen:
    """2 training steps of the shapes demo (configs/demo/shapes.yaml and `configs` overlays) on 8
    generated 16 px images through main.py, as `make demo` / `scripts/demo.py --config` train it,
    started in the background (`start_main`: several go side by side); `demo_run_folder` waits
    for it."""
    from make_shapes import make_shapes

    make_shapes(tmp / "shapes", n=8, size=16, seed=0)
    demo = ROOT / "configs" / "demo"
    args = [
        "--base",
        str(demo / "shapes.yaml"),
        *map(str, configs),
        f"data.params.train.params.data_root={tmp / 'shapes'}",
        "data.params.batch_size=4",
        "lightning.trainer.max_steps=2",
        "-l",
        str(tmp / "logs"),
        "-t",
    ]
    return start_main(args, tmp, tmp / "stderr.txt")


def demo_run_folder(tmp: Path, process: subprocess.Popen) -> Path:
    """The run folder of `start_demo(tmp, ...)`'s run, which must succeed."""
    assert process.wait(timeout=300) == 0, (tmp / "stderr.txt").read_text()[-3000:]
    (run,) = list((tmp / "logs").iterdir())
    return run


def train_demo(tmp: Path, *configs: Path) -> Path:
    """`start_demo`'s run, waited for: the run folder."""
    return demo_run_folder(tmp, start_demo(tmp, *configs))


def record_demo_commands(monkeypatch, run_folder: Path) -> list[tuple]:
    """`scripts/demo.py`'s commands recorded instead of run (the list fills as `demo.main` goes):
    txt2img's grid is a blank PNG, the training run's folder is `run_folder`."""
    import demo
    from PIL import Image

    calls = []

    def fake_run(*args, capture_run_folder=False):
        calls.append(args)
        if args[0] == "scripts/txt2img.py":
            outdir = Path(args[args.index("--outdir") + 1])
            outdir.mkdir(parents=True)
            Image.new("RGB", (20, 38)).save(outdir / "grid-0000.png")
        return str(run_folder) if capture_run_folder else ""

    monkeypatch.setattr(demo, "run", fake_run)
    return calls


# Two local processes under torchrun. `--standalone` has the launcher bind a free port itself: a
# port picked by the test and bound later by torchrun can be taken in between by another job.
TORCHRUN_TWO = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
]


def script_outcome(main, argv, capsys) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of a script's main(argv) in this process."""
    capsys.readouterr()
    try:
        status = main([str(a) for a in argv])
    except SystemExit as stop:
        status = stop.code
    return status, capsys.readouterr().err.splitlines()


def assert_one_line(status, lines, *words):
    """Exit status 2 and one stderr line holding each of `words` (docs/errors.md's promise)."""
    assert status == 2, lines
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])
