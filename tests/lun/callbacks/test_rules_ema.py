"""The EMA's synchronous path (`async_update: false`) against the average written out by hand:
shadow_k = keep * shadow_{k-1} + (1 - keep) * weights_k (LitEma / Polyak averaging), keep the
product of the per-step decays since the last update."""

import pytest
import torch
from callback_testing import SeedEveryStep, WeightRecorder
from torch.testing import assert_close

from lun.callbacks.ema import EMA


@pytest.mark.parametrize("update_every", [1, 2])
def test_synchronous_update_equals_the_hand_computed_average(
    make_module, make_loader, fit, update_every
):
    decay, max_steps = 0.8, 4
    recorder = WeightRecorder()
    ema = EMA(decay=decay, update_every=update_every, warmup="none", async_update=False)
    fit(
        make_module(), [SeedEveryStep(), recorder, ema], make_loader(batches=4), max_steps=max_steps
    )
    assert ema._executor is None  # the synchronous path did the updates
    keep = decay**update_every
    expected = {n: w.double() for n, w in recorder.by_step[0].items()}
    for step in range(update_every, max_steps + 1, update_every):
        weights = recorder.by_step[step]
        expected = {n: keep * s + (1 - keep) * weights[n].double() for n, s in expected.items()}
    for name, shadow in ema.shadows.items():
        assert_close(shadow.double(), expected[name], rtol=1e-5, atol=1e-6)
    # The weights moved, so an average moving by `keep` (or not at all) would differ.
    start, end = recorder.by_step[0], recorder.by_step[max_steps]
    assert any(not torch.allclose(start[n], end[n]) for n in start)


def test_synchronous_and_asynchronous_updates_agree(make_module, make_loader, fit):
    shadows = []
    for async_update in (False, True):
        ema = EMA(decay=0.7, warmup="litema", async_update=async_update)
        fit(make_module(), [SeedEveryStep(), ema], make_loader(batches=3), max_steps=3)
        shadows.append(ema.shadows)
    for name in shadows[0]:
        assert_close(shadows[0][name], shadows[1][name])
