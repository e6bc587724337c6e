"""What the default callbacks do on a step that neither logs nor saves: nothing rebuilt and no
tensor value read on the host (the host-device syncs on an accelerator). Counted, not timed, on a
tiny model with every default callback (`lun.callbacks.defaults`) plus EMA, as main.py builds them;
the fast companion of test_loop_sync.py (the demo model through main.py, slow)."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from callback_testing import TinyDiffusion
from lightning.pytorch.loggers import CSVLogger

from ldm.util import instantiate_from_config
from lun.atomic_io import AtomicCheckpointIO
from lun.callbacks.defaults import default_callback_configs
from lun.callbacks.ema import EMA
from lun.callbacks.nan_guard import NaNGuard

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import benchmark_loop  # noqa: E402

STEPS, EVERY = 9, 4


class FusedAdamW(TinyDiffusion):
    """As LatentDiffusion: the fused AdamW (the NaN guard's device path), and the loss logged
    without `prog_bar` (Lightning reads progress-bar values after every batch)."""

    def training_step(self, batch, batch_idx):
        loss = self.diffusion_loss(batch["image"])
        self.log("train/loss", loss, batch_size=len(batch["caption"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, fused=True)


class Identities(pl.Callback):
    """After each optimizer step, the objects the callbacks build once and reuse (held, so that
    no id is freed and reused)."""

    def __init__(self):
        self.by_step: dict[int, tuple] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ema = next(c for c in trainer.callbacks if isinstance(c, EMA))
        guard = next(c for c in trainer.callbacks if isinstance(c, NaNGuard))
        self.by_step[trainer.global_step] = (
            ema._params,
            ema._lists,
            ema.shadows,
            guard._device_counts,
        )


def test_a_step_that_does_not_log_rebuilds_nothing_and_reads_no_value(tmp_path, make_loader):
    configs = default_callback_configs(str(tmp_path), has_validation=False, use_ema=True)
    configs["progress_bar"]["params"]["log_every_n_steps"] = EVERY
    clock, identities = benchmark_loop.StepClock(), Identities()
    callbacks = [clock.callback, *map(instantiate_from_config, configs.values()), identities]
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        logger=CSVLogger(tmp_path),
        callbacks=callbacks,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        plugins=[AtomicCheckpointIO()],
    )
    with clock.counting_host_reads():
        trainer.fit(FusedAdamW(), make_loader(batches=2 * STEPS))  # no epoch end
    assert trainer.global_step == STEPS
    # Step 1 sizes buffers and counts FLOPs; steps 4 and 8 log, 9 ends training.
    assert set(clock.reads) <= {1, EVERY, 2 * EVERY, STEPS}, clock.reads
    # The EMA's parameter dict, its foreach lists, the shadows and the NaN guard's device
    # counters are those of step 1 on every later step.
    first = identities.by_step[1]
    for step, objects in identities.by_step.items():
        rebuilt = [i for i, (a, b) in enumerate(zip(first, objects)) if a is not b]
        assert not rebuilt, f"step {step} rebuilt {rebuilt} (EMA params, lists, shadows, counters)"
