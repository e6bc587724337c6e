"""Every strategy row of the memory plan against a hand count of what each rank holds.

The rules, stated apart from our code (ZeRO paper, Rajbhandari et al. 2020, arXiv:1910.02054,
sec. 5 and fig. 1; DeepSpeed's config docs; torch FSDP's ShardingStrategy docs):
  DDP / FSDP NO_SHARD   every rank holds all weights, gradients and optimizer state.
  ZeRO-1                partitions the optimizer state (under mixed precision that state is the
                        fp32 master weights + both Adam moments, K = 12 bytes per parameter).
  ZeRO-2 / SHARD_GRAD_OP  + the gradients.
  ZeRO-3 / FULL_SHARD   + the weights.
  offload_optimizer (ZeRO), offload_param (ZeRO-3), FSDP cpu_offload: those parts in host RAM.
  8-bit AdamW (bitsandbytes): one byte per moment + an fp32 absmax per block of 256 values;
                        tensors under 4096 values keep fp32 moments.
The tiny module has N = 64 * 32 + 32 = 2080 trainable values; nothing below is read from the plan
to compute what the plan should say.
"""

import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from trainer_helpers import quiet_trainer

from ldm.model_contract import TrainingContract
from lun.memory import memory_plan
from lun.strategies import DeepSpeedStrategy, FSDPStrategy, sharding

N = 64 * 32 + 32  # trainable values: nn.Linear(64, 32)
RANKS = 2


class Tiny(TrainingContract, pl.LightningModule):
    def __init__(self, optimizer=torch.optim.AdamW):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = nn.Linear(64, 32)
        self.first_stage_model = nn.Linear(4, 4).requires_grad_(False)
        self.optimizer = optimizer

    @property
    def ema_module(self):
        return self.model

    def configure_optimizers(self):
        return self.optimizer(self.model.parameters(), lr=1e-3)


def plan(strategy="auto", precision="32-true", devices=RANKS, optimizer=torch.optim.AdamW):
    trainer = quiet_trainer(devices=devices, strategy=strategy, precision=precision)
    made = memory_plan(Tiny(optimizer), trainer, activations=0, host_budget=2**40)
    return {p.name: p.nbytes for p in made.parts}


# (strategy, weights, gradients, optimizer state) per rank, fp32 AdamW (4 bytes, 2 moments).
FULL, HALF = 4 * N, 4 * N // RANKS
ROWS = {
    "ddp": ("ddp", FULL, FULL, 2 * FULL),
    "zero1": (lambda: DeepSpeedStrategy(stage=1), FULL, FULL, 2 * HALF),
    "zero2": (lambda: DeepSpeedStrategy(stage=2), FULL, HALF, 2 * HALF),
    "zero3": (lambda: DeepSpeedStrategy(stage=3), HALF, HALF, 2 * HALF),
    "fsdp_no_shard": (lambda: FSDPStrategy(sharding_strategy="NO_SHARD"), FULL, FULL, 2 * FULL),
    "fsdp_grad_op": (lambda: FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), FULL, HALF, 2 * HALF),
    "fsdp_full": (lambda: FSDPStrategy(sharding_strategy="FULL_SHARD"), HALF, HALF, 2 * HALF),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_each_strategy_divides_exactly_what_it_shards(row):
    strategy, weights, gradients, optimizer = ROWS[row]
    got = plan(strategy if isinstance(strategy, str) else strategy())
    assert (got["weights (trainable)"], got["gradients"], got["optimizer state"]) == (
        weights,
        gradients,
        optimizer,
    )


def test_single_device_holds_everything():
    got = plan(devices=1)
    assert (got["weights (trainable)"], got["gradients"], got["optimizer state"]) == (
        FULL,
        FULL,
        2 * FULL,
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_mixed_precision_partitions_the_12_bytes_of_optimizer_state(stage):
    """ZeRO paper sec. 3.1: mixed-precision Adam keeps 2 bytes of fp16/bf16 weights, 2 of
    gradients and K = 12 of optimizer state (fp32 master copy, momentum, variance) per parameter;
    stage 1 divides the 12, stage 2 also the 2 of gradients, stage 3 also the 2 of weights."""
    got = plan(DeepSpeedStrategy(stage=stage), precision="bf16-mixed")
    assert got["optimizer state"] == 12 * N // RANKS
    assert got["gradients"] == 2 * N // (RANKS if stage >= 2 else 1)
    assert got["weights (trainable)"] == 2 * N // (RANKS if stage >= 3 else 1)


def test_eight_bit_adamw_state_by_hand():
    bnb = pytest.importorskip("bitsandbytes")
    # weight: 2048 values < 4096 -> fp32 moments; so is the bias. Make one tensor large enough.
    got = plan(devices=1, optimizer=bnb.optim.AdamW8bit)
    assert got["optimizer state"] == 2 * N * 4  # both tensors under min_8bit_size

    class Wide(Tiny):
        def __init__(self):
            super().__init__(bnb.optim.AdamW8bit)
            self.model.diffusion_model = nn.Linear(100, 50)  # 5000 values: 20 blocks of 256

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    made = memory_plan(Wide(), trainer, activations=0, host_budget=2**40)
    state = next(p.nbytes for p in made.parts if p.name == "optimizer state")
    assert state == 2 * (5000 * 1 + math.ceil(5000 / 256) * 4) + 2 * 50 * 4


@pytest.mark.parametrize(
    "make, optimizer_on_host, weights_on_host",
    [
        (lambda: DeepSpeedStrategy(stage=2), False, False),
        (lambda: DeepSpeedStrategy(stage=2, offload_optimizer=True), True, False),
        (
            lambda: DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True),
            True,
            True,
        ),
        (lambda: FSDPStrategy(sharding_strategy="FULL_SHARD"), False, False),
        (lambda: FSDPStrategy(cpu_offload=True), True, True),
    ],
)
def test_offload_puts_exactly_the_offloaded_parts_in_host_ram(
    make, optimizer_on_host, weights_on_host
):
    report = sharding(make(), RANKS, RANKS)
    assert (report.optimizer_on_host, report.weights_on_host) == (
        optimizer_on_host,
        weights_on_host,
    )


def test_hybrid_shard_divides_among_the_ranks_of_one_machine():
    """FSDP HYBRID_SHARD: full shards within a node, replicas across nodes (4 ranks, 2 a node)."""
    report = sharding(
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={nn.Linear}),
        world=4,
        local=2,
    )
    assert (report.weights, report.gradients, report.optimizer) == (2, 2, 2)


def test_lightning_classes_named_by_target_shard_as_the_adapters():
    """A `target:` naming Lightning's own DeepSpeed / FSDP class (or a subclass) holds the same
    settings: ZeRO-2 shards gradients and optimizer state, FULL_SHARD all three."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
    from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP

    def parts(strategy):
        report = sharding(strategy, world=RANKS, local=RANKS)
        return report.weights, report.gradients, report.optimizer

    assert parts(LightningDeepSpeed(stage=2)) == (1, RANKS, RANKS)
    assert parts(LightningFSDP(sharding_strategy="FULL_SHARD")) == (RANKS, RANKS, RANKS)
    assert parts(DDPStrategy()) == (1, 1, 1)
