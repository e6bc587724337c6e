import math

import lightning.pytorch as pl
import pytest
import torch

from lun.callbacks.epoch_stats import EpochStats
from lun.callbacks.measure import batch_size_of
from lun.callbacks.progress import SmoothedProgressBar, SmoothedValue, format_duration


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) * trainer.accumulate_grad_batches)


def test_log_mode_writes_one_full_line_every_n_steps(make_module, make_loader, fit, capsys):
    bar, recorder = (
        SmoothedProgressBar(log_every_n_steps=2, smoothing_window=4, interactive=False),
        LossRecorder(),
    )
    trainer = fit(make_module(), [recorder, bar], make_loader(batches=8), max_steps=6)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    assert "\r" not in err
    for part in ("loss ", " it/s", " img/s", "eta ", "lr "):
        assert part in lines[-1], part
    assert f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}" in lines[-1]

    # The loss shown is the bias-corrected moving average of the real (per-step) losses.
    beta = 1 - 1 / 4
    average = sum(
        (1 - beta) * beta ** (len(recorder.losses) - 1 - i) * x
        for i, x in enumerate(recorder.losses)
    )
    expected = average / (1 - beta ** len(recorder.losses))
    assert bar.loss.value == pytest.approx(expected, rel=1e-5)
    assert f"loss {expected:.4f}" in lines[-1]


def test_images_per_second_counts_accumulated_batches(make_module, make_loader, fit, capsys):
    bar = SmoothedProgressBar(log_every_n_steps=1, interactive=False)
    fit(
        make_module(),
        [bar],
        make_loader(batches=8, batch_size=2),
        max_steps=3,
        accumulate_grad_batches=2,
    )
    seconds = bar.step_seconds.value
    assert bar.images_per_step == 4
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step 3/3")][0]
    assert f"{4 / seconds:.1f} img/s" in line and f"{1 / seconds:.2f} it/s" in line


def test_terminal_mode_redraws_one_line(make_module, make_loader, fit, capsys):
    bar = SmoothedProgressBar(interactive=True, refresh_seconds=0)
    fit(make_module(), [bar], make_loader(), max_steps=3)
    err = capsys.readouterr().err
    assert err.count("\rstep ") == 3 and err.endswith("\n")
    assert "step 3/3" in err.split("\r")[-1]


def test_terminal_mode_reads_the_loss_at_most_every_refresh_seconds(
    make_module, make_loader, fit, capsys
):
    """Each redraw reads the loss on the host (a device sync): with an hour between redraws a
    run draws its first step and its last state only, and reads the loss no more often."""
    reads = []

    class CountedValue(SmoothedValue):
        @property
        def value(self):
            reads.append(self.count)
            return super().value

    class CountingBar(SmoothedProgressBar):
        def _reset_meters(self):
            super()._reset_meters()
            self.loss = CountedValue(self.smoothing_window)

    bar = CountingBar(interactive=True, refresh_seconds=3600)
    fit(make_module(), [bar], make_loader(batches=8), max_steps=6)
    err = capsys.readouterr().err
    assert [line.split(" | ")[0] for line in err.split("\r")[1:]] == ["step 1/6", "step 6/6"]
    assert reads == [1, 6]


def test_smoothed_value_starts_unbiased():
    value = SmoothedValue(window=100)
    assert value.value is None
    value.update(torch.tensor(2.0))
    assert value.value == pytest.approx(2.0)
    value.update(4.0)
    assert 2.0 < value.value < 4.0


def test_format_duration_and_batch_size():
    assert format_duration(93784) == "1d 02:03:04"
    assert format_duration(59) == "00:00:59"
    assert format_duration(math.inf) == "?"
    assert batch_size_of({"caption": ["a", "b", "c"], "image": torch.zeros(3, 3, 8, 8)}) == 3
    assert batch_size_of({"caption": ["a", "b"]}) == 2
    with pytest.raises(ValueError, match="batch size"):
        batch_size_of({"n": 3})


def test_epoch_stats_logs_time_and_throughput(make_module, make_loader, fit):
    trainer = fit(
        make_module(),
        [EpochStats()],
        make_loader(batches=2, batch_size=2),
        max_steps=-1,
        max_epochs=2,
    )
    metrics = trainer.callback_metrics
    assert metrics["epoch/time_s"] > 0
    assert float(metrics["epoch/images_per_s"]) == pytest.approx(
        4 / float(metrics["epoch/time_s"]), rel=0.05
    )
    assert "epoch/peak_memory_gb" not in metrics  # no accelerator here
