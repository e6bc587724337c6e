import pytest
import torch
from callback_testing import WeightRecorder

from lun.callbacks.nan_guard import NaNGuard, NonFiniteLossError


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_a_nan_step_is_skipped_and_counted(make_module, make_loader, fit):
    guard, recorder = NaNGuard(max_consecutive=3), WeightRecorder()
    # Batch 2 (the third optimizer step) is all NaN.
    trainer = fit(
        make_module(), [recorder, guard], make_loader(batches=4, nan_batches=[2]), max_steps=4
    )
    steps = recorder.by_step
    assert not same(steps[2], steps[1]) and not same(steps[4], steps[3])
    assert same(steps[3], steps[2])  # the bad step changed nothing
    assert all(torch.isfinite(w).all() for w in steps[4].values())
    assert guard.skipped_steps == 1 and guard.consecutive == 0
    assert trainer.callback_metrics["train/skipped_steps"] == 1


def test_one_bad_micro_batch_skips_its_whole_accumulated_step(make_module, make_loader, fit):
    guard, recorder = NaNGuard(), WeightRecorder()
    # Batches 2 and 3 form optimizer step 2; only batch 3 is NaN.
    fit(
        make_module(),
        [recorder, guard],
        make_loader(batches=6, nan_batches=[3]),
        max_steps=3,
        accumulate_grad_batches=2,
    )
    assert same(recorder.by_step[2], recorder.by_step[1])
    assert not same(recorder.by_step[3], recorder.by_step[2])
    assert guard.skipped_steps == 1


def test_too_many_bad_steps_stop_with_the_last_good_weights(
    make_module, make_loader, fit, tmp_path
):
    guard, recorder = NaNGuard(max_consecutive=3, dirpath=str(tmp_path / "ckpt")), WeightRecorder()
    loader = make_loader(batches=10, nan_batches=range(2, 10))  # good steps 1-2, bad from step 3 on
    with pytest.raises(
        NonFiniteLossError, match=r"3 optimizer steps in a row \(steps 3-5\)"
    ) as error:
        fit(make_module(), [recorder, guard], loader, max_steps=10)
    path = tmp_path / "ckpt" / "last-good.ckpt"
    assert str(path) in str(error.value)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == 5
    assert all(
        torch.equal(checkpoint["state_dict"]["model." + n], w)
        for n, w in recorder.by_step[2].items()
    )
    assert checkpoint["callbacks"][guard.state_key] == {"skipped_steps": 3, "consecutive": 3}


def test_bad_setting_is_refused():
    with pytest.raises(ValueError, match="max_consecutive"):
        NaNGuard(max_consecutive=0)
