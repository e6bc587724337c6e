"""The 2-process strategies compute the numbers of one process: after STEPS optimizer steps of
DDP, FSDP and DeepSpeed ZeRO-2/3 on CPU, the weights equal a single-process run on the same global
batches, and the EMA (decay above 0, no warm-up) equals the average computed by hand.

Both sides see the same samples with the same timesteps and noise (`strategy_checks.FixedDraws`):
rank r of 2 trains on samples 4s + 2r and 4s + 2r + 1 of step s, the single process on all 4.
Plain SGD, so the update is -lr x gradient and a wrong gradient average (a loss divided twice, a
missing all-reduce) shows in full. DeepSpeed ZeRO-2 takes each rank's share as 2 micro-batches
of 1 (gradient accumulation): Lightning divides the loss by the accumulation and DeepSpeed's
`engine.backward` divided it again (lun.strategies passes `scale_wrt_gas=False`), which halves
every update. Also the script that the 2 processes run:

    torchrun --nproc-per-node 2 tests/lun/test_strategy_numbers.py OUT_DIR ddp fsdp ...
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from strategy_checks import FixedDraws, tiny_model
from torch.testing import assert_close
from torch.utils.data import DataLoader

import ldm.diffusion
import ldm.objectives
from ldm.layout.ema import ema_key
from lun.callbacks.ema import EMA

STEPS = 3
GLOBAL_BATCH = 4
DECAY = 0.6
ACCUMULATE = {"deepspeed_stage_2": 2}  # micro-batches per optimizer step, on each rank


def samples_of(rank: int, world_size: int) -> list[int]:
    """The sample indices rank `rank` trains on, in order (its share of every global batch)."""
    per_rank = GLOBAL_BATCH // world_size
    return [
        step * GLOBAL_BATCH + rank * per_rank + i for step in range(STEPS) for i in range(per_rank)
    ]


def train(strategy, devices: int, rank: int = 0, callbacks=(), accumulate: int = 1) -> pl.Trainer:
    """STEPS steps of the tiny LDM (SGD) with an EMA, on this rank's share of the samples (in
    `accumulate` micro-batches per step)."""
    generator = torch.Generator().manual_seed(1)
    count = STEPS * GLOBAL_BATCH
    latents = torch.randn(count, 4, 8, 8, generator=generator)
    t = torch.randint(0, 1000, (count,), generator=generator)
    noise = torch.randn(count, 4, 8, 8, generator=generator)
    mine = samples_of(rank, devices)
    items = [{"latent": latents[i], "caption": f"shape number {i}"} for i in mine]
    loader = DataLoader(items, batch_size=GLOBAL_BATCH // devices // accumulate, shuffle=False)
    model = tiny_model()
    ema = EMA(decay=DECAY, warmup="none", update_every=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,  # each rank's loader already holds its share
        callbacks=[ema, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    original_torch, ldm.objectives.torch = ldm.objectives.torch, FixedDraws(t[mine], noise[mine])
    try:
        trainer.fit(model, loader)
    finally:
        ldm.objectives.torch = original_torch
    return trainer


class WeightsPerStep(pl.Callback):
    """The UNet weights before training and after every optimizer step."""

    def __init__(self):
        self.weights = []

    def _record(self, pl_module):
        named = pl_module.model.named_parameters()
        self.weights.append({n: p.detach().clone() for n, p in named if p.requires_grad})

    def on_train_start(self, trainer, pl_module):
        self._record(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(pl_module)


@pytest.fixture(scope="module")
def single_process():
    """(weights before and after each step, the trainer) of one process on the global batches."""
    recorder = WeightsPerStep()
    trainer = train("auto", devices=1, callbacks=[recorder])
    return recorder.weights, trainer


def hand_ema(weights: list[dict]) -> dict[str, torch.Tensor]:
    """ema_0 = w_0, ema_s = DECAY ema_{s-1} + (1 - DECAY) w_s; written out as the sum
    DECAY^S w_0 + sum_s (1 - DECAY) DECAY^(S - s) w_s, in float64."""
    last = len(weights) - 1
    return {
        name: DECAY**last * weights[0][name].double()
        + sum(
            (1 - DECAY) * DECAY ** (last - s) * weights[s][name].double()
            for s in range(1, last + 1)
        )
        for name in weights[0]
    }


def test_single_process_ema_is_the_hand_computed_average(single_process):
    weights, trainer = single_process
    assert len(weights) == STEPS + 1
    assert any(not torch.equal(weights[-1][n], weights[0][n]) for n in weights[0])  # it trained
    ema = next(cb for cb in trainer.callbacks if isinstance(cb, EMA))
    assert ema.num_updates == STEPS
    expected = hand_ema(weights)
    for name, average in expected.items():
        assert_close(ema.shadows[name].double(), average, rtol=1e-5, atol=1e-7)
    # The average is neither the last weights nor the first: the decay really weighs them.
    name = next(iter(expected))
    assert not torch.allclose(ema.shadows[name], weights[-1][name])


STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")


@pytest.fixture(scope="module", autouse=True)
def launch(request, tmp_path_factory):
    """The 2-process runs `two_processes` reads, started with the module when this session
    runs a test that reads them: the single-process run then trains beside their start-up,
    which leaves a core idle (rank 1 starts once rank 0 is set up). (its folder, its process)

    One torchrun launch runs every strategy in turn (the process group is made once and
    reused): starting 2 processes costs more than their 3 steps.
    """
    wanted = any(
        "two_processes" in item.fixturenames
        for item in request.session.items
        if item.module is request.module
    )
    if not wanted:
        yield None
        return
    out = tmp_path_factory.mktemp("two_processes")
    from run_helpers import TORCHRUN_TWO  # here: torchrun runs this file as a script

    command = [*TORCHRUN_TWO, __file__, str(out), *STRATEGIES]
    with (out / "stderr.txt").open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    yield out, process
    process.kill()  # a test that failed first leaves no run going
    process.wait()


@pytest.fixture(scope="module")
def two_processes(launch) -> Path:
    """A folder with `<strategy>.ckpt` after STEPS steps of 2 processes under each strategy."""
    out, process = launch
    assert process.wait(timeout=900) == 0, (out / "stderr.txt").read_text()[-5000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_make_the_single_process_steps_and_average(
    two_processes, single_process, strategy
):
    import lun.strategies

    saved = lun.strategies.load_training_checkpoint(two_processes / f"{strategy}.ckpt")
    assert saved["global_step"] == STEPS
    state = saved["state_dict"]
    weights, _ = single_process
    expected_ema = hand_ema(weights)
    for name, value in weights[-1].items():
        assert_close(state["model." + name].float(), value, rtol=1e-4, atol=1e-6)
        assert_close(state[ema_key(name)].double(), expected_ema[name], rtol=1e-4, atol=1e-6)
    assert int(state["model_ema.num_updates"]) == STEPS


def main(out: str, *strategy_names: str) -> None:
    """One of the 2 processes torchrun starts: each strategy in turn, a checkpoint after each."""
    from lun.strategies import build_strategy

    rank = int(os.environ["RANK"])
    for name in strategy_names:
        trainer = train(build_strategy(name), 2, rank, accumulate=ACCUMULATE.get(name, 1))
        trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))  # every rank takes part
    # Out of the collector's reach: the interpreter's exit then skips its last full collection
    # of every object torch, Lightning and DeepSpeed made (seconds a rank, waited for by torchrun).
    gc.freeze()


if __name__ == "__main__":
    main(*sys.argv[1:])
