"""The memory plan: its parts equal hand-computed bytes for a tiny model under each setting, the
probe measures a known activation, and a plan over its budget stops the launcher with one line."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from ldm.model_contract import TrainingContract
from lun.callbacks.ema import EMA
from lun.memory import HOST, MemoryPlanError, memory_plan
from lun.memory_probe import peak_allocated
from lun.strategies import DeepSpeedStrategy

TRAINABLE = 100 * 50 + 50  # nn.Linear(100, 50)
FROZEN = 10 * 10 + 10  # nn.Linear(10, 10), frozen
BUFFER = 7  # a float buffer of the module itself
ACTIVATIONS = 1000  # given: measured by the probe test below


class PlanModule(TrainingContract, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = nn.Linear(100, 50)
        self.first_stage_model = nn.Linear(10, 10).requires_grad_(False)
        self.register_buffer("schedule", torch.zeros(BUFFER))

    @property
    def ema_module(self):
        return self.model

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def plan_of(precision="32-true", devices=1, strategy="auto"):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        callbacks=[EMA()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return memory_plan(PlanModule(), trainer, activations=ACTIVATIONS, host_budget=2**40)


def parts(plan) -> dict[str, int]:
    return {p.name: p.nbytes for p in plan.parts if p.name != "process"}


def test_fp32_plan_is_the_hand_computed_bytes():
    plan = plan_of("32-true")
    weights = TRAINABLE * 4
    assert parts(plan) == {
        "weights (trainable)": weights,
        "gradients": weights,
        "optimizer state": 2 * weights,  # AdamW: two fp32 moments
        "frozen: buffers of the module": BUFFER * 4,
        "frozen: first_stage_model": FROZEN * 4,
        "activations": ACTIVATIONS,
        "EMA": weights,  # fp32 shadows
        "EMA staging": weights,  # fp32 weights copied for the averaging
        "checkpoint save": 0,
        "checkpoint read": 100 * 50 * 4,  # the largest tensor
    }
    process = next(p.nbytes for p in plan.parts if p.name == "process")
    held = 6 * weights + (BUFFER + FROZEN) * 4 + process  # weights, gradients, 2 moments, EMA x2
    assert plan.peaks(HOST) == {
        "training": held + ACTIVATIONS,
        "saving": held,  # no activations between steps, no copy to write
        # no gradients yet, EMA staging not yet written, one tensor read
        "resuming": held - 2 * weights + 100 * 50 * 4,
    }


def test_bf16_weights_plan_is_the_hand_computed_bytes():
    plan = plan_of("bf16-true")
    weights = TRAINABLE * 2
    assert parts(plan) == {
        "weights (trainable)": weights,
        "gradients": weights,
        "optimizer state": 2 * weights,  # torch's AdamW keeps its moments in the weights' dtype
        "frozen: buffers of the module": BUFFER * 2,  # the whole module is cast
        "frozen: first_stage_model": FROZEN * 2,
        "activations": ACTIVATIONS,
        "EMA": TRAINABLE * 4,  # fp32 shadows
        "EMA staging": weights,  # bf16 weights copied for the averaging
        "checkpoint save": 0,
        "checkpoint read": 100 * 50 * 2,
    }


def test_8bit_adamw_option_saves_the_hand_computed_bytes():
    """bitsandbytes' AdamW8bit: one byte per moment plus an fp32 absmax per 256 values; tensors
    under 4096 values keep fp32 moments."""
    plan = plan_of("32-true")
    weight_8bit = 2 * (5000 + 20 * 4)  # 5000 values: 20 blocks of 256
    bias_fp32 = 2 * 50 * 4  # 50 values < 4096
    option = next(o for o in plan.options if o["name"] == "8-bit AdamW")
    assert option["saves"] == {HOST: 2 * TRAINABLE * 4 - (weight_8bit + bias_fp32)}


def test_8bit_adamw_state_is_the_hand_computed_bytes():
    bnb = pytest.importorskip("bitsandbytes")
    from lun.memory import optimizer_state_bytes

    layer = nn.Linear(100, 50)
    optimizer = bnb.optim.AdamW8bit(layer.parameters())
    nbytes, _ = optimizer_state_bytes(optimizer, lambda p: p.dtype)
    assert nbytes == 2 * (5000 + 20 * 4) + 2 * 50 * 4


def test_zero2_with_two_ranks_shards_gradients_and_optimizer_state():
    plan = plan_of("32-true", devices=2, strategy=DeepSpeedStrategy(stage=2))
    weights = TRAINABLE * 4
    got = parts(plan)
    assert got["weights (trainable)"] == weights  # ZeRO-2 keeps full weights on every rank
    assert got["gradients"] == weights // 2
    assert got["optimizer state"] == 2 * weights // 2
    # Two gradient reduction buffers of reduce_bucket_size (2e8) fp32 values, whatever the model.
    assert got["DeepSpeed buckets"] == 2 * 200_000_000 * 4
    assert got["EMA"] + got["EMA staging"] == 2 * weights  # every rank keeps the full average
    assert plan.local_ranks == 2
    per_rank = sum(
        p.nbytes for p in plan.parts if p.name not in ("checkpoint save", "checkpoint read")
    )
    assert plan.peaks(HOST)["training"] == 2 * per_rank  # both processes on this machine


def test_a_plan_over_budget_names_what_would_fit():
    plan = plan_of("32-true")
    plan.host_budget = plan.peak(HOST) - 10_000  # 8-bit AdamW (-29840 B) and LoRA would fit
    with pytest.raises(MemoryPlanError) as raised:
        plan.check()
    message = str(raised.value)
    assert "\n" not in message
    assert "8-bit AdamW (model.params.optimizer_config.target=adamw8bit" in message
    assert "no EMA" in message and "LoRA" in message
    plan.host_budget = plan.peak(HOST)
    plan.check()  # exactly at the limit: fits


class Scale(TrainingContract, pl.LightningModule):
    """loss = sum(batch * w): the step's only large allocations are batch-sized (B, N) tensors,
    one at a time (the product in forward, the gradient's product in backward)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def training_step(self, batch, batch_idx):
        return (batch * self.w).sum()


def test_the_probe_measures_the_activations_of_a_step():
    from lun.memory_probe import measure_activations

    rows, n = 8, 2**16  # gradients (n values) are 1/8 of the activations: leaving them in shows
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = Scale(n)
    measured = measure_activations(module, torch.randn(rows, n), trainer)
    assert measured == pytest.approx(rows * n * 4, rel=0.05)  # the gradients are left out
    assert module.w.grad is None  # and left as they were


def test_peak_allocated_counts_tensors_alive_together():
    def allocate():
        a = torch.ones(2**18)  # 1 MiB
        b = torch.ones(2**19)  # 2 MiB, both alive
        del a, b
        c = torch.ones(2**18)  # 1 MiB after both were freed
        return c.sum()

    assert peak_allocated(allocate, torch.device("cpu")) == pytest.approx(3 * 2**20, rel=0.01)


@pytest.mark.slow
def test_launcher_plans_without_a_run_folder_and_stops_over_budget(
    tmp_path, tiny_config, shapes_dir
):
    from run_helpers import run_main_here  # neither run trains: no second start-up of torch

    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={shapes_dir}"]
    args += ["-l", str(tmp_path / "logs")]
    planned = run_main_here([*args, "--plan"], cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "memory plan (host RAM, per rank):" in planned.stdout
    assert "= training peak" in planned.stdout and "activations" in planned.stdout
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing

    over = run_main_here([*args, "-t", "--host-memory", "0.1"], cwd=tmp_path)
    assert over.returncode == 2
    errors = over.stderr.strip().splitlines()
    assert errors[-1].startswith("config error: memory plan: the run needs ")
    assert "of host RAM, the limit is 102.4 MiB" in errors[-1]
    assert "Traceback" not in over.stderr
    assert not (tmp_path / "logs").exists()  # stopped before the run folder


def test_the_plan_is_one_line_unless_a_peak_is_over_80_percent_of_its_budget():
    from lun.memory import ACTIVATIONS, HOST, MemoryPlan, Part

    parts = [Part("weights", 50 * 2**20, HOST), Part(ACTIVATIONS, 30 * 2**20, HOST)]
    roomy = MemoryPlan(parts, device="cpu", host_budget=2**30)  # 80 MiB of 1 GiB
    assert not roomy.tight()
    assert (
        roomy.line() == "memory plan: peak 80.0 MiB host RAM of 1.00 GiB (--plan shows the parts)"
    )
    assert MemoryPlan(parts, device="cpu", host_budget=90 * 2**20).tight()  # 80 of 90 MiB: 89 %
    assert not MemoryPlan(parts, device="cpu", host_budget=101 * 2**20).tight()  # 79 %
