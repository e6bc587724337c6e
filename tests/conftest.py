"""Shared fixtures: a tiny generated image set and the tiny LatentDiffusion config."""

import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "scripts"),
    str(ROOT / "tests"),
]  # scripts and test helpers import by name

from run_helpers import train_here  # noqa: E402

# One thread per process, here and in every launch the tests make (they inherit os.environ): at
# the tests' tiny widths a second OpenMP thread buys nothing, and on a shared 2-core machine its
# spin-waiting doubled the CPU time of a launched run (tests/e2e/test_main's two runs: 54 -> 26
# CPU s). torchrun already gives each rank one; a test that wants more sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The Ctrl-C tests send SIGINT to the runs they launch; a pytest started where SIGINT is ignored
# (a background job of a shell without job control: `(pytest &)`) would pass that on to them, as
# exec keeps an ignored signal ignored. A handler of our own is reset to the default on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Dataset index caches of test runs (and their launcher subprocesses) stay out of ~/.cache.
os.environ["LUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="lun_test_cache_")


@contextlib.contextmanager
def _environment_restored():
    """os.environ and torch's thread count as they were. A script's main() called in this
    process sets the count its own run wants (scripts/cache_latents.py: one per core), and every
    later test then computed on 2 threads: on a shared 2-core machine their spin-waiting made
    tests/e2e/test_configs' in-process SD runs 5-15x slower (2 s -> 19-31 s)."""
    before, threads = dict(os.environ), torch.get_num_threads()
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """Each test leaves os.environ (and torch's thread count) as it found it: a launcher run in this process sets
    PL_GLOBAL_SEED (seed_everything), MASTER_PORT and more, and a later test's Trainer reads them
    (Lightning seeds its distributed sampler with PL_GLOBAL_SEED)."""
    with _environment_restored():
        yield


@pytest.fixture(autouse=True, scope="module")
def environment_as_the_module_found_it():
    """The same for a module's fixtures: they are set up before the per-test snapshot above, so
    what one sets (a module-scoped trained model sets PL_GLOBAL_SEED) would otherwise reach every
    later module's tests."""
    with _environment_restored():
        yield


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    """16 generated 32x32 images with captions, in the flat-file layout."""
    from make_shapes import make_shapes

    out = tmp_path_factory.mktemp("shapes")
    make_shapes(out, n=16, size=32, seed=0)
    return out


@pytest.fixture(scope="session")
def shape_classes_dir(tmp_path_factory) -> Path:
    """36 generated 16x16 images in 18 class folders (colour-shape), for class-conditional models."""
    from make_shapes import make_shapes

    out = tmp_path_factory.mktemp("shape_classes")
    make_shapes(out, n=36, size=16, seed=0, layout="classes")
    return out


@pytest.fixture(scope="session")
def tiny_config() -> Path:
    return ROOT / "configs" / "tiny" / "ldm.yaml"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_config, shapes_dir) -> Path:
    """A run folder from a 2-step training of the tiny config, with EMA weights in its checkpoint."""
    logs = tmp_path_factory.mktemp("logs")
    # main() in this process: the run is the same, without a second start-up of torch and
    # Lightning (tests/e2e/test_main.py launches the command line itself).
    return train_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            "model.params.use_ema=true",
        ],
        logs=logs,
        cwd=logs,
    )
