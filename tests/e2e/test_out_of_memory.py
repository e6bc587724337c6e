"""Out of memory is a sentence: an allocator's refusal in the memory plan's probe or in training
is one line (what did not fit, by how much, the options) and exit status 2, never a traceback.

The refusals are real ones from torch's CPU allocator, provoked by asking it for 4 EiB
(tests/allocator_faults.py): nothing large is ever allocated."""

import os

import pytest
import torch
from run_helpers import ROOT, run_main, run_main_here

from lun.memory import is_out_of_memory, out_of_memory_message

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
OPTIONS = ("smaller batch", "gradient checkpointing", "latent cache", "lower resolution")


def refusal() -> RuntimeError:
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("the allocator gave 4 EiB")


def test_allocator_refusals_are_recognised_and_others_are_not():
    assert is_out_of_memory(refusal())
    cuda = "CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacity of 79 GiB"
    assert is_out_of_memory(torch.OutOfMemoryError(cuda))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("not enough memory"))


def test_message_says_what_did_not_fit_by_how_much_and_the_options():
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 ...")
    line = out_of_memory_message(cuda, "the probe step", "cuda:0 memory", 80 * 2**30)
    assert "\n" not in line
    assert "out of memory in the probe step: an allocation of 32.00 GiB did not fit" in line
    assert "cuda:0 memory: 80.00 GiB in all" in line
    assert all(option in line for option in OPTIONS), line
    # The CPU allocator counts bytes: 2**62 of them are 2**32 GiB.
    line = out_of_memory_message(refusal(), "the first training step", "host RAM", None)
    assert f"an allocation of {2**32:.2f} GiB did not fit (host RAM)" in line


def only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "out of memory" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_oversized_image_in_the_probe_is_one_line_before_the_run_folder(tmp_path, shapes_dir):
    """The 32 px images at 512 px on a VAE that holds 64 x 64: the probe's step fails in the
    allocator; the plan's line comes instead, and no run folder."""
    vae = "model.params.first_stage_config"
    args = ["--base", TINY, f"data.params.train.params.data_root={shapes_dir}"]
    args += ["data.params.train.params.size=512", f"{vae}.target=allocator_faults.SmallMemoryVAE"]
    args += [f"{vae}.params.max_pixels=4096", "-l", tmp_path / "logs", "-t"]
    result = run_main_here(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    line = only_line(result.stderr)
    assert line.startswith("config error: memory plan: out of memory in the probe step (batch 2)")
    assert all(option in line for option in OPTIONS), line
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_refusal_in_the_first_step_is_one_line_and_exit_2(tmp_path, shapes_dir):
    args = ["--base", str(TINY), f"data.params.train.params.data_root={shapes_dir}"]
    args += ["lightning.callbacks.refuse={target: allocator_faults.RefuseAllocationAtStep}"]
    args += ["-l", str(tmp_path / "logs"), "-t"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    result = run_main(args, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    line = only_line(result.stderr)
    assert "out of memory in the first training step: an allocation of" in line, line
    assert all(option in line for option in OPTIONS), line
