"""SIGUSR1 under DDP: one rank's signal is agreed on by all (no deadlock), but only every
`agree_every` optimizer steps - agreeing is a collective and a host read, which must not
happen at every step (issue 30: no host-device sync in a default step but logging steps)."""

import pytest
import torch
from callback_testing import run_two_ranks

DDP_SCRIPT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
from torch.utils.data import DataLoader
from callback_testing import RandomImages, TinyDiffusion
from lun.callbacks.signals import SignalCheckpoint

class SignalOnRankOne(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told to save

trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
    log_every_n_steps=3, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, use_distributed_sampler=False,
    callbacks=[SignalOnRankOne(), SignalCheckpoint(sys.argv[2])])
trainer.fit(TinyDiffusion(), DataLoader(RandomImages(16), batch_size=2))
import torch.distributed
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # two processes (~15 s): the agreement needs a real collective
def test_one_ranks_sigusr1_is_agreed_on_at_the_next_logging_step(tmp_path):
    output = run_two_ranks(DDP_SCRIPT, tmp_path, tmp_path / "checkpoints")
    # Signalled after step 1 on rank 1; steps 1 and 2 do not agree; step 3 (log_every_n_steps)
    # does, and both ranks save there.
    assert "SIGUSR1: saving" in output and output.count("SIGUSR1: saving") == 1, output[-3000:]
    assert "at step 3, training goes on" in output, output[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3
