"""main.py's training loop reads no tensor value on the host (the host-device syncs on an
accelerator) except on the steps that log: guarded at tiny size with scripts/benchmark_loop.py's
counter, which patches torch.Tensor's value-reading methods."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import benchmark_loop  # noqa: E402


def test_the_counter_sees_a_host_read():
    clock = benchmark_loop.StepClock()
    clock.step = 4
    with clock.counting_host_reads():
        bool(torch.isfinite(torch.ones(3)).all())
        torch.ones(2).sum().item()
    assert clock.reads == {4: 2}


@pytest.mark.slow
def test_main_py_reads_values_only_on_logging_steps(tmp_path):
    torch.set_num_threads(1)
    data = benchmark_loop.make_data(tmp_path / "shapes", 16)
    dotlist = benchmark_loop.overrides(data, steps=8, width=32, batch_size=4, every=3)
    # The throughput's warm-up ends at step 5 (a window closes there, logged nowhere).
    dotlist.append("lightning.callbacks.throughput.params.warmup_steps=5")
    clock = benchmark_loop.main_py_loop(benchmark_loop.DEMO, dotlist, tmp_path / "logs")
    assert len(clock.ends) == 8  # 4 batches an epoch: two epoch boundaries crossed
    # Step 1 counts FLOPs and sizes buffers; 3 and 6 log; 4 and 8 end an epoch (its line is
    # printed); 8 is also the end of training. Steps 2, 5 and 7 must not read anything.
    assert set(clock.reads) - {1} <= {3, 6} | {4, 8}, clock.reads
