"""The benchmarks' timing loop (scripts/bench_common): the compared steps take turns and warm-up
is not timed."""

import torch
from bench_common import alternated_median_seconds, median_seconds


def test_steps_take_turns_and_warm_up_runs_are_not_timed():
    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    medians = alternated_median_seconds(steps, torch.device("cpu"), repeats=3, warmup=2)
    assert calls == ["a", "b"] * 5
    assert set(medians) == {"a", "b"} and all(0 <= s < 1 for s in medians.values())


def test_median_of_one_callable_times_a_slow_step_as_slow():
    calls = []
    seconds = median_seconds(lambda: calls.append(sum(range(200_000))), torch.device("cpu"), 3, 1)
    fast = median_seconds(lambda: None, torch.device("cpu"), 3, 1)
    assert len(calls) == 4 and seconds > fast
