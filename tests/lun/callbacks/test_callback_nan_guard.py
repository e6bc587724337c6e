import pytest
import torch
from callback_testing import TinyDiffusion, WeightRecorder
from lightning.pytorch.callbacks import Callback

from lun.callbacks.nan_guard import NaNGuard, NonFiniteLossError, nonfinite_flag


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


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_the_flag_is_any_non_finite_entry_and_leaves_the_gradients_bit_for_bit(bad):
    # Entries whose squares overflow fp32 (3e38) and a -0 are finite: no flag, nothing changed.
    grads = [
        torch.tensor([3e38, -3e38, -0.0, 1e-45]),
        torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
        torch.ones(7, dtype=torch.float16),
    ]
    if bad is not None:
        grads[1][2, 3] = bad
    bits = [g.view(torch.int32 if g.dtype == torch.float32 else torch.int16).clone() for g in grads]
    flag = nonfinite_flag(grads)
    expected = not all(bool(x) for g in grads for x in torch.isfinite(g.float()).flatten())
    assert flag.shape == () and flag.item() == float(expected) == float(bad is not None)
    for g, b in zip(grads, bits):
        assert torch.equal(g.view(b.dtype), b)


def test_bad_setting_is_refused():
    with pytest.raises(ValueError, match="max_consecutive"):
        NaNGuard(max_consecutive=0)


# --- the device-side path: fused optimizers skip on an on-device flag, no host sync per step ---


class FusedAdamW(TinyDiffusion):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, fused=True)


class StateRecorder(Callback):
    """Weights and AdamW state (step, moments) after each optimizer step, cloned."""

    def __init__(self):
        self.by_step = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        state = {
            f"{i}.{k}": v.clone()
            for i, p in enumerate(pl_module.model.parameters())
            for k, v in optimizer.state[p].items()
        }
        weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
        self.by_step[trainer.global_step] = (weights, state, hasattr(optimizer, "found_inf"))


def test_fused_optimizer_nan_step_leaves_weights_and_optimizer_state_bitwise_unchanged(
    make_loader, fit
):
    torch.manual_seed(0)
    guard, recorder = NaNGuard(max_consecutive=3), StateRecorder()
    trainer = fit(
        FusedAdamW(), [recorder, guard], make_loader(batches=5, nan_batches=[2]), max_steps=5
    )
    steps = recorder.by_step
    assert len(steps[2][1]) == 4 * 3  # step, exp_avg, exp_avg_sq of 4 tensors
    assert same(steps[3][0], steps[2][0]) and same(steps[3][1], steps[2][1])  # step 3 was NaN
    assert not same(steps[4][0], steps[3][0]) and not same(steps[4][1], steps[3][1])
    assert steps[4][1]["0.step"].item() == 3  # AdamW counted 3 real steps out of 4
    assert not any(found for _, _, found in steps.values())  # the flag is for one step only
    assert guard.skipped_steps == 1 and guard.consecutive == 0  # read at the end of training
    assert trainer.global_step == 5


def test_fused_optimizer_stop_at_a_logging_step_is_exact(make_loader, fit, tmp_path):
    guard = NaNGuard(max_consecutive=3, dirpath=str(tmp_path / "ckpt"), check_every=1)
    recorder = StateRecorder()
    loader = make_loader(batches=10, nan_batches=range(2, 10))
    torch.manual_seed(0)
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row \(steps 3-5\);"):
        fit(FusedAdamW(), [recorder, guard], loader, max_steps=10)
    checkpoint = torch.load(tmp_path / "ckpt" / "last-good.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
    assert checkpoint["callbacks"][guard.state_key] == {"skipped_steps": 3, "consecutive": 3}


def test_fused_optimizer_stop_seen_late_still_keeps_the_last_good_weights(
    make_loader, fit, tmp_path
):
    # Steps 3-5 are NaN (the stop is reached at 5), then the data is good again; the counters are
    # read only at step 8. The weights must still be those of step 2: every step after the stop
    # is skipped on the device.
    guard = NaNGuard(max_consecutive=3, dirpath=str(tmp_path / "ckpt"), check_every=8)
    recorder = StateRecorder()
    loader = make_loader(batches=10, nan_batches=[2, 3, 4])
    torch.manual_seed(0)
    with pytest.raises(
        NonFiniteLossError, match=r"3 optimizer steps in a row \(steps 3-5\) \(seen at step 8"
    ):
        fit(FusedAdamW(), [recorder, guard], loader, max_steps=10)
    checkpoint = torch.load(tmp_path / "ckpt" / "last-good.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 8
    for step in (3, 4, 5, 6, 7, 8):
        assert same(recorder.by_step[step][0], recorder.by_step[2][0])
        assert same(recorder.by_step[step][1], recorder.by_step[2][1])
    assert all(
        torch.equal(checkpoint["state_dict"]["model." + n], w)
        for n, w in recorder.by_step[2][0].items()
    )
