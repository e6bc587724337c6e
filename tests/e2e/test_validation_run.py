"""The fixed-noise validation loss in real runs: validating leaves training bit for bit as it was;
2 processes (DDP, gloo) give the single process's figures; `main.py --validate-only` prints them
for a checkpoint and writes nothing into its run folder. Also the script the 2 processes run:

    torchrun --nproc-per-node 2 tests/e2e/test_validation_run.py SHAPES_DIR OUT.json
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

from ldm.util import instantiate_from_config
from lun.callbacks.ema import EMA
from lun.config import merge_configs, to_container
from lun.data import DataModule

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny" / "ldm.yaml"


def tiny_model():
    torch.manual_seed(0)
    return instantiate_from_config(to_container(merge_configs([TINY], []))["model"])


def shapes_data(shapes_dir, validation_batch: int | None = None, train_batch: int = 2):
    local = {"target": "lun.data.local.Local", "params": {"data_root": str(shapes_dir), "size": 32}}
    validation = {**local, "batch_size": validation_batch} if validation_batch else None
    return DataModule(train=local, validation=validation, batch_size=train_batch, seed=0)


def trainer(**kwargs) -> pl.Trainer:
    settings = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    return pl.Trainer(**{**settings, **kwargs})


@pytest.mark.slow
def test_validating_leaves_the_training_weights_bit_for_bit(shapes_dir):
    """3 steps with an EMA, validated (EMA swapped in) before and after every step, against the
    same 3 steps unvalidated: the same weights and EMA shadows, exactly."""
    runs = []
    for validate in (False, True):
        pl.seed_everything(5)
        model = tiny_model()
        ema = EMA(decay=0.5, warmup="none")
        extra = dict(val_check_interval=1, limit_val_batches=2, num_sanity_val_steps=1)
        fit = trainer(max_steps=3, callbacks=[ema], **(extra if validate else {}))
        fit.fit(model, datamodule=shapes_data(shapes_dir, validation_batch=3 if validate else None))
        if validate:
            assert "val/loss_t750-999" in fit.callback_metrics
        runs.append(({k: v.clone() for k, v in model.state_dict().items()}, dict(ema.shadows)))
    (weights, shadows), (validated, validated_shadows) = runs
    assert weights.keys() == validated.keys()
    assert all(torch.equal(weights[k], validated[k]) for k in weights)
    assert all(torch.equal(shadows[k], validated_shadows[k]) for k in shadows)


def figures_of(shapes_dir, validation_batch: int) -> dict[str, float]:
    model = tiny_model()
    (logged,) = trainer().validate(
        model, datamodule=shapes_data(shapes_dir, validation_batch), verbose=False
    )
    assert logged["val/loss"] == pytest.approx(model.validation_loss.last["val/loss"], rel=1e-6)
    return model.validation_loss.last


@pytest.mark.slow
def test_two_processes_give_the_single_process_figures(shapes_dir, tmp_path):
    """16 items in batches of 6 on 2 ranks: rank 1 repeats batch 0 to match rank 0's count; each
    item still counts once. One process with batches of 4 must agree."""
    out = tmp_path / "ddp.json"
    from run_helpers import TORCHRUN_TWO  # here: torchrun runs this file as a script

    command = [*TORCHRUN_TWO, __file__, str(shapes_dir), str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    ddp = json.loads(out.read_text())
    assert ddp["items"] == 16
    assert_close(ddp["figures"], figures_of(shapes_dir, validation_batch=4), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_validate_only_prints_the_figures_and_leaves_the_run_folder(
    trained_run, shapes_dir, tmp_path
):
    from run_helpers import run_main, run_main_here

    files = sorted(p for p in trained_run.rglob("*"))
    validation = [
        "data.params.validation.target=lun.data.local.Local",
        f"data.params.validation.params.data_root={shapes_dir}",
        "data.params.validation.params.size=32",
        "data.params.validation.params.limit_images=6",
    ]
    out = tmp_path / "figures.json"
    result = run_main(
        ["--validate-only", str(trained_run), "--out", str(out), *validation],
        cwd=tmp_path,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p for p in trained_run.rglob("*")) == files
    record = json.loads(out.read_text())
    assert "(EMA weights)" in record["weights"]
    figures = record["figures"]
    assert list(figures) == [
        "val/loss",
        "val/loss_t0-249",
        "val/loss_t250-499",
        "val/loss_t500-749",
        "val/loss_t750-999",
        "val/loss_simple",
        "val/loss_simple_ema",
        "val/items",
    ]
    assert figures["val/items"] == 6
    for name, value in figures.items():
        assert f"  {name:<19}  {value:.6g}\n" in result.stdout
    # The EMA weights, not the raw ones (the run trained 2 steps: they differ). In this process
    # from here on: the launch above was the command line's.
    raw = run_main_here(
        ["--validate-only", str(trained_run), "--raw-weights", *validation], cwd=tmp_path
    )
    assert raw.returncode == 0, raw.stderr[-3000:]
    assert "(raw weights)" in raw.stdout
    assert f"validating {trained_run / 'checkpoints'}" in raw.stderr  # not "resuming from"
    assert f"{figures['val/loss']:.6g}" not in raw.stdout
    # Without a validation set: one line, exit status 2.
    bare = run_main_here(["--validate-only", str(trained_run)], cwd=tmp_path)
    assert bare.returncode == 2
    assert bare.stderr.strip().splitlines()[-1] == (
        "config error: --validate-only: the config has no data.params.validation "
        "(a held-out image set)"
    )


def main(shapes_dir: str, out: str) -> None:
    """One of the 2 processes torchrun starts: the validation of the tiny model under DDP."""
    model = tiny_model()
    run = trainer(devices=2, strategy="ddp")
    run.validate(model, datamodule=shapes_data(shapes_dir, validation_batch=6), verbose=False)
    if int(os.environ["RANK"]) == 0:
        record = {"items": model.validation_loss.items, "figures": model.validation_loss.last}
        Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
