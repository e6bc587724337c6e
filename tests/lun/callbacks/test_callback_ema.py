import math
import os
import re
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from callback_testing import (
    SeedEveryStep,
    TinyDiffusion,
    WeightRecorder,
    run_two_ranks,
    trainable_weights,
)
from torch import nn
from torch.testing import assert_close

from lun.atomic_io import AtomicCheckpointIO
from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.ema import EMA, ema_weights
from lun.memory_probe import peak_allocated


def reference_decay(warmup: str, decay: float, n: int) -> float:
    """The decay at update n, written out from the formulas (not from the implementation)."""
    if warmup == "litema":
        return min(decay, (1 + n) / (10 + n))
    if warmup == "power":
        return min(decay, 1 - n ** (-2 / 3))
    return decay


@pytest.mark.parametrize(
    "update_every, accumulate, warmup",
    [(1, 1, "litema"), (3, 2, "power"), (2, 1, "none")],
)
def test_ema_equals_hand_computed_average(
    make_module, make_loader, fit, update_every, accumulate, warmup
):
    decay, max_steps = 0.9, 6
    recorder = WeightRecorder()
    ema = EMA(decay=decay, update_every=update_every, warmup=warmup)
    module = make_module()
    fit(
        module,
        [SeedEveryStep(), recorder, ema],
        make_loader(batches=8),
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
    )

    # shadow_k = keep * shadow_{k-1} + (1 - keep) * weights_k, keep = product of per-step decays.
    expected = {n: w.double() for n, w in recorder.by_step[0].items()}
    for step in range(update_every, max_steps + 1, update_every):
        keep = math.prod(
            reference_decay(warmup, decay, n) for n in range(step - update_every + 1, step + 1)
        )
        expected = {
            n: keep * s + (1 - keep) * recorder.by_step[step][n].double()
            for n, s in expected.items()
        }
    assert ema.num_updates == max_steps // update_every * update_every
    assert sorted(ema.shadows) == sorted(expected)
    for name, shadow in ema.shadows.items():
        assert_close(shadow.double(), expected[name], rtol=1e-5, atol=1e-6)
    # The average is not simply the last weights (the test would pass trivially otherwise).
    final = trainable_weights(module)
    assert any(not torch.equal(ema.shadows[n], final[n]) for n in final)


def test_resume_continues_the_same_average(make_module, make_loader, fit, tmp_path):
    loader = make_loader(
        batches=1, same=True
    )  # one identical batch per epoch: data order cannot differ

    def run(ckpt_path=None, folder="a"):
        ema = EMA(decay=0.8, update_every=2)
        saver = Checkpoint(dirpath=str(tmp_path / folder), every_n_train_steps=3, save_top_k=-1)
        module = make_module()
        fit(module, [SeedEveryStep(), ema, saver], loader, max_steps=6, ckpt_path=ckpt_path)
        return module, ema

    module_a, ema_a = run()
    # Step 3 is between two EMA updates (every 2 steps): the resumed run must still agree.
    module_b, ema_b = run(ckpt_path=str(tmp_path / "a" / "step-000000003.ckpt"), folder="b")
    assert ema_b.num_updates == ema_a.num_updates == 6
    for name in ema_a.shadows:
        assert torch.equal(ema_a.shadows[name], ema_b.shadows[name]), name
    assert all(
        torch.equal(a, b) for a, b in zip(module_a.model.parameters(), module_b.model.parameters())
    )


def test_ema_lives_on_the_cpu_and_is_saved_in_the_original_layout(
    make_module, make_loader, fit, tmp_path
):
    ema = EMA(decay=0.95)
    module = make_module()
    fit(
        module,
        [ema, Checkpoint(dirpath=str(tmp_path), filename="final", every_n_train_steps=4)],
        make_loader(),
        max_steps=4,
    )

    params = dict(module.model.named_parameters())
    for name, shadow in ema.shadows.items():
        assert shadow.device.type == "cpu" and shadow.dtype == torch.float32
        assert shadow.untyped_storage().data_ptr() != params[name].untyped_storage().data_ptr()
    assert all(t.device.type == "cpu" for t in ema._staging.values())

    state = torch.load(tmp_path / "final.ckpt", weights_only=True)["state_dict"]
    trainable = [n for n, p in module.model.named_parameters() if p.requires_grad]
    for name in trainable:
        key = "model_ema." + name.replace(".", "")  # e.g. model_ema.diffusion_model0weight
        assert torch.equal(state[key], ema.shadows[name])
        assert torch.equal(state["model." + name], params[name].detach())  # raw weights stay raw
    assert state["model_ema.decay"].dtype == torch.float32 and state["model_ema.decay"].dim() == 0
    assert state["model_ema.decay"].item() == pytest.approx(0.95)
    assert (
        state["model_ema.num_updates"].dtype == torch.int32
        and state["model_ema.num_updates"].item() == 4
    )
    shadows = [k for k in state if k.startswith("model_ema.")]
    assert len(shadows) == len(trainable) + 2


def test_ema_weights_context_swaps_in_and_out(make_module, make_loader, fit):
    ema = EMA(decay=0.9)
    module = make_module()
    trainer = fit(module, [ema], make_loader())
    raw = trainable_weights(module)
    with ema_weights(trainer, module):
        assert all(torch.equal(w, ema.shadows[n]) for n, w in trainable_weights(module).items())
        with ema_weights(trainer, module):  # nested: no second swap
            pass
        assert all(torch.equal(w, ema.shadows[n]) for n, w in trainable_weights(module).items())
    assert all(torch.equal(w, raw[n]) for n, w in trainable_weights(module).items())
    assert not all(torch.equal(raw[n], ema.shadows[n]) for n in raw)


def test_ema_weights_is_a_no_op_without_ema(make_module, make_loader, fit):
    module = make_module()
    trainer = fit(module, [], make_loader(), max_steps=1)
    before = trainable_weights(module)
    with ema_weights(trainer, module):
        inside = trainable_weights(module)
    assert all(torch.equal(before[n], inside[n]) for n in before)


class ValidationProbe(pl.Callback):
    def __init__(self, ema):
        self.ema, self.seen = ema, []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        shadows = {n: s.clone() for n, s in self.ema.shadows.items()}
        self.seen.append((trainer.global_step, trainable_weights(pl_module), shadows))


def test_validation_runs_with_ema_and_checkpoints_keep_raw_weights(
    make_module, make_loader, fit, tmp_path
):
    ema = EMA(decay=0.9)
    probe, recorder = ValidationProbe(ema), WeightRecorder()
    best = Checkpoint(dirpath=str(tmp_path), monitor="val/loss", save_top_k=-1)
    fit(
        make_module(),
        [recorder, ema, probe, best],
        make_loader(),
        make_loader(batches=1),
        max_steps=4,
        val_check_interval=2,
    )

    assert [step for step, _, _ in probe.seen] == [2, 4]
    for step, weights, shadows in probe.seen:
        assert all(torch.equal(weights[n], shadows[n]) for n in weights)
        assert not all(torch.equal(weights[n], recorder.by_step[step][n]) for n in weights)
        state = torch.load(tmp_path / f"best-val_loss-step-{step:09d}.ckpt", weights_only=True)[
            "state_dict"
        ]
        assert all(torch.equal(state["model." + n], recorder.by_step[step][n]) for n in weights)


def test_model_parallel_strategy_is_refused():
    # FSDP and ZeRO-3 are gathered (tests/lun/test_strategies.py); DTensor model parallel is not.
    from lightning.pytorch.strategies import ModelParallelStrategy

    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        EMA._check_strategy(SimpleNamespace(strategy=ModelParallelStrategy()))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        EMA(warmup="cosine")
    with pytest.raises(ValueError, match="update_every"):
        EMA(update_every=0)


DDP_SCRIPT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from callback_testing import RandomImages, TinyDiffusion
from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.ema import EMA

class SaveShadows(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        ema = next(c for c in trainer.callbacks if isinstance(c, EMA))
        saved = {"shadows": ema.shadows, "update_every": ema.update_every}
        torch.save(saved, os.path.join(sys.argv[2], f"rank{trainer.global_rank}.pt"))

class SlowRank1(pl.Callback):  # rank 1's host folds slower: its own timing would choose another N
    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:
            fold_in = EMA._fold_in
            def slow_fold_in(ema, *args, **kwargs):
                time.sleep(0.02)
                return fold_in(ema, *args, **kwargs)
            EMA._fold_in = slow_fold_in

torch.manual_seed(0)
module = TinyDiffusion()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=9, logger=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[2],
    callbacks=[EMA(decay=0.9, update_every="auto", budget=0.005), SaveShadows(), SlowRank1(),
               Checkpoint(dirpath=os.path.join(sys.argv[2], "ckpt"), every_n_train_steps=9)])
trainer.fit(module, DataLoader(RandomImages(12), batch_size=2, shuffle=False))
import torch.distributed
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # two processes (~15 s): the ranks must agree through a real collective
def test_ddp_ranks_keep_identical_averages_and_rank0_writes(tmp_path):
    """update_every: auto, with rank 1's steps slower: both ranks take rank 0's N (under FSDP a
    rank folding alone would wait in the weights' gather for ever)."""
    run_two_ranks(DDP_SCRIPT, tmp_path, tmp_path)
    ckpt_dir = tmp_path / "ckpt"
    saved0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    saved1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert saved0["update_every"] == saved1["update_every"]
    rank0, rank1 = saved0["shadows"], saved1["shadows"]
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    assert sorted(os.listdir(ckpt_dir)) == ["every-9-steps.ckpt"]
    state = torch.load(ckpt_dir / "every-9-steps.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(state["model_ema." + n.replace(".", "")], rank0[n]) for n in rank0)


class WideDiffusion(TinyDiffusion):
    """TinyDiffusion with 2.4 M trainable weights (9.5 MB): large enough that a copy of them
    at save time stands out from a checkpoint's fixed small tensors (RNG states, counters)."""

    def __init__(self):
        super().__init__()
        self.model.diffusion_model = nn.Sequential(
            nn.Conv2d(3, 512, 1), nn.SiLU(), nn.Conv2d(512, 512, 3, padding=1), nn.Conv2d(512, 3, 1)
        )


@pytest.mark.parametrize("inside_ema_block", [False, True])
def test_saving_with_ema_allocates_no_copy_of_the_weights(
    make_loader, fit, tmp_path, inside_ema_block
):
    """A run must never need more memory to save than to train: the checkpoint is written from
    the shadows (and, inside an EMA block, the raw weights' staging buffers) themselves."""
    torch.manual_seed(0)
    module, ema = WideDiffusion(), EMA(decay=0.9)
    trainer = fit(module, [ema], make_loader(batches=2), max_steps=2)
    path = tmp_path / "saved.ckpt"

    def save():
        if inside_ema_block:
            with ema_weights(trainer, module):
                trainer.save_checkpoint(path)
        else:
            trainer.save_checkpoint(path)

    model_bytes = sum(p.numel() * p.element_size() for p in module.model.parameters())
    assert peak_allocated(save, torch.device("cpu")) < 0.02 * model_bytes
    state = torch.load(path, weights_only=True)["state_dict"]
    for name, p in module.model.named_parameters():
        assert torch.equal(state["model_ema." + name.replace(".", "")], ema.shadows[name])
        assert torch.equal(state["model." + name], p.detach())  # raw weights, even inside


def test_resume_reads_the_weights_into_the_model_one_tensor_at_a_time(make_loader, fit, tmp_path):
    """Beyond the optimizer state (which becomes the optimizer's own), a resume holds one tensor
    of the file at a time: no second copy of the weights or the EMA."""
    torch.manual_seed(0)
    module, ema = WideDiffusion(), EMA(decay=0.9)
    trainer = fit(module, [ema], make_loader(batches=2), max_steps=2)
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizers[0].state.values()
        for t in state.values()
    )
    largest = max(p.numel() * p.element_size() for p in module.parameters())
    torch.manual_seed(1)
    resumed = WideDiffusion()

    def restore():
        checkpoint = AtomicCheckpointIO().load_checkpoint(path)
        resumed.load_state_dict(checkpoint["state_dict"])
        ema_state = EMA(decay=0.9)
        ema_state.shadows = {n: torch.zeros_like(s) for n, s in ema.shadows.items()}
        ema_state.on_load_checkpoint(None, resumed, checkpoint)
        ema_state._apply_loaded()
        return ema_state

    shadows_bytes = sum(s.numel() * s.element_size() for s in ema.shadows.values())
    # The restored EMA's own buffers are allocated inside `restore` too (as on_train_start does).
    limit = optimizer_bytes + shadows_bytes + largest + 2**16
    assert peak_allocated(restore, torch.device("cpu")) < limit
    restored = restore()
    for (name, p), q in zip(module.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    for name, shadow in ema.shadows.items():
        assert torch.equal(restored.shadows[name], shadow), name


def test_auto_update_every_is_the_smallest_n_within_the_budget():
    from lun.callbacks.ema import choose_update_every

    # 3 % of a 200 ms step is 6 ms; a 100 ms update needs N = ceil(100 / 6) = 17 steps.
    assert choose_update_every(0.100, 0.200, 0.03) == 17
    assert choose_update_every(0.006, 0.200, 0.03) == 1  # exactly the budget: every step
    assert choose_update_every(0.0061, 0.200, 0.03) == 2
    assert choose_update_every(0.5, 0.1, 0.05) == 100


class UpdateSteps(pl.Callback):
    """The optimizer steps after which the EMA's update count changed (seen from outside)."""

    def __init__(self, ema):
        self.ema, self.steps, self.seen = ema, [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.ema.num_updates != self.seen:
            self.steps.append(trainer.global_step)
            self.seen = self.ema.num_updates


def test_auto_ema_equals_hand_computed_average_and_prints_its_choice(
    make_module, make_loader, fit, caplog
):
    caplog.set_level("INFO")
    decay, max_steps = 0.9, 12
    ema = EMA(decay=decay, update_every="auto", budget=0.5, warmup="none")
    recorder, updates = WeightRecorder(), UpdateSteps(ema)
    fit(
        make_module(),
        [SeedEveryStep(), recorder, ema, updates],
        make_loader(batches=12),
        max_steps=max_steps,
    )
    assert updates.steps[0] == 1 and len(updates.steps) >= 2  # timed first update, then every N
    expected, last = {n: w.double() for n, w in recorder.by_step[0].items()}, 0
    for step in updates.steps:
        keep = decay ** (step - last)  # decay^N for the N steps since the last update
        expected = {
            n: keep * s + (1 - keep) * recorder.by_step[step][n].double()
            for n, s in expected.items()
        }
        last = step
    assert ema.num_updates == updates.steps[-1]
    for name, shadow in ema.shadows.items():
        assert_close(shadow.double(), expected[name], rtol=1e-5, atol=1e-6)
    line = f"EMA: shadows in host RAM, updated every {ema.update_every} optimizer step(s)"
    assert line in caplog.text


def test_a_fixed_update_every_prints_its_cost_and_the_n_that_would_fit(
    make_module, make_loader, fit, caplog
):
    """A fixed N keeps its N (and its exact average) but still says what it costs; over the
    budget the line names the N that fits: ceil(update / (budget x step)) of the printed times."""
    caplog.set_level("INFO")
    ema = EMA(decay=0.9, update_every=1, budget=1e-6, warmup="none")
    updates = UpdateSteps(ema)
    fit(make_module(), [SeedEveryStep(), ema, updates], make_loader(batches=8), max_steps=8)
    assert updates.steps == list(range(1, 9)) and ema.update_every == 1  # N is the user's
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("EMA:"))
    assert line.startswith("EMA: shadows in host RAM, updated every 1 optimizer step(s)")
    found = re.search(r"over the budget: update_every=(\d+) \(or 'auto'\) would fit", line)
    assert found, line
    # 1e-6 of a step is far less than any update: the fitting N is large (hand bound: an
    # update costs at least ~1e-3 of this tiny model's step).
    assert int(found.group(1)) > 100, line


def test_bf16_weights_fold_into_fp32_shadows(make_module, make_loader, fit):
    """Weights in bf16 (precision bf16-true) are folded in as fp32 values: the fp32 average of
    the recorded bf16 weights, by the formula (shadow <- d * shadow + (1 - d) * weight)."""
    decay, max_steps = 0.5, 3
    recorder, ema, module = WeightRecorder(), EMA(decay=decay, warmup="none"), make_module()
    fit(
        module,
        [SeedEveryStep(), recorder, ema],
        make_loader(batches=4),
        max_steps=max_steps,
        precision="bf16-true",
    )
    assert {p.dtype for p in module.ema_module.parameters()} == {torch.bfloat16}
    expected = {n: w.double() for n, w in recorder.by_step[0].items()}
    for step in range(1, max_steps + 1):
        expected = {
            n: decay * s + (1 - decay) * recorder.by_step[step][n].double()
            for n, s in expected.items()
        }
    for name, shadow in ema.shadows.items():
        assert shadow.dtype == torch.float32
        assert_close(shadow.double(), expected[name], rtol=1e-6, atol=1e-7)
