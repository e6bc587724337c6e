"""The Throughput callback: FLOPs counted right, MFU and images/s from them, data wait, report."""

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from callback_testing import RandomImages, TinyDiffusion, run_two_ranks
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from ldm.model_contract import TrainingContract
from ldm.util import instantiate_from_config
from lun.callbacks.epoch_stats import EpochStats
from lun.callbacks.progress import SmoothedProgressBar
from lun.callbacks.throughput import (
    FlopCounter,
    Throughput,
    describe_shape,
    measured_matmul_flops,
    shape_key,
    table_peak_flops,
    training_dtype,
)
from lun.run import RunDir
from lun.trainer import build_callbacks

ROOT = Path(__file__).resolve().parents[3]
PEAK = 1e9  # an injected peak FLOP/s: MFU is then exactly flops x img/s / 1e9


class TwoLinear(TrainingContract, pl.LightningModule):
    """Linear(16, 32) -> ReLU -> Linear(32, 8): FLOPs that can be counted by hand."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Vectors(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return {"x": torch.randn(16, generator=g), "y": torch.randn(8, generator=g)}


def test_flops_per_image_of_a_linear_model_are_the_hand_count(fit):
    throughput = Throughput(peak_flops=PEAK)
    fit(TwoLinear(), [throughput], DataLoader(Vectors(), batch_size=4), max_steps=3)
    # Per sample: forward 2*16*32 + 2*32*8; backward: weight gradients of both layers, the input
    # gradient of the second only (the data needs none). Biases and ReLU are no matmuls.
    forward = 2 * 16 * 32 + 2 * 32 * 8
    backward = 2 * 16 * 32 + 2 * (2 * 32 * 8)
    assert throughput.flops_per_image == {(("x", (16,)), ("y", (8,))): forward + backward}


class TwoUpdates(TwoLinear):
    """Manual optimization with two backward passes a step (as the VAE's generator and
    discriminator updates)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self.net(batch["x"]), batch["y"]))
            optimizer.step()


def test_a_manually_optimised_step_is_counted_to_its_last_backward(fit):
    throughput = Throughput(peak_flops=PEAK)
    fit(TwoUpdates(), [throughput], DataLoader(Vectors(), batch_size=4), max_steps=3)
    forward = 2 * 16 * 32 + 2 * 32 * 8  # the hand count of the test above, twice a step
    backward = 2 * 16 * 32 + 2 * (2 * 32 * 8)
    assert throughput.flops_per_image == {(("x", (16,)), ("y", (8,))): 2 * (forward + backward)}


def test_the_counted_step_computes_bit_for_bit_what_an_uncounted_one_does():
    """A resumed run counts its first step again: counting must not change a single bit.
    (FlopCounterMode would: it decomposes silu_backward, and here rounds differently.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    w = torch.randn(256, 256, generator=g, requires_grad=True)

    def gradient(mode) -> torch.Tensor:
        w.grad = None
        with mode:
            F.silu(x @ w).square().sum().backward()
        return w.grad

    plain = gradient(torch.enable_grad())
    counter = FlopCounter()
    assert torch.equal(gradient(counter), plain)
    with FlopCounterMode(display=False) as reference:
        gradient(torch.enable_grad())
    # The forward matmul and the weight gradient (x needs none).
    assert counter.flops == reference.get_total_flops() == 2 * (2 * 64 * 256 * 256)


def tiny_ldm_config() -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "configs/tiny/ldm.yaml")["model"])


def count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


class CaptionedImages(Dataset):
    def __init__(self, length: int, size: int = 32):
        self.length, self.size = length, size

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        image = torch.rand(3, self.size, self.size, generator=g) * 2 - 1
        return {"image": image, "caption": f"a shape number {index}"}


@pytest.mark.slow
def test_flops_of_the_tiny_ldm_step_are_its_parts_counted_alone(fit):
    """The step's count = VAE encode + text encoder + UNet forward and backward, each counted
    directly on the bare part (nothing else, e.g. the optimizer, adds FLOPs)."""
    torch.manual_seed(0)
    model = instantiate_from_config(tiny_ldm_config())
    model.learning_rate = 1e-4
    throughput = Throughput(peak_flops=PEAK)
    fit(model, [throughput], DataLoader(CaptionedImages(2), batch_size=2), max_steps=1)
    ((key, per_image),) = throughput.flops_per_image.items()
    assert key == (("image", (3, 32, 32)),)

    batch = next(iter(DataLoader(CaptionedImages(2), batch_size=2)))
    model.train()
    with torch.no_grad():
        vae = count(lambda: model.encode_first_stage(batch["image"]))
        text = count(lambda: model.conditioning(batch, drop=False))
        z = model.encode_first_stage(batch["image"])
        cond = model.conditioning(batch, drop=False)
    t = torch.tensor([10, 900])
    unet = count(lambda: model.apply_model(z, t, cond).float().square().mean().backward())
    assert vae > 0 and text > 0 and unet > 0
    assert per_image * 2 == vae + text + unet


@pytest.mark.slow
def test_flops_of_a_tiny_dit_are_its_forward_and_backward(fit):
    from ldm.dit import DiT

    class DiTStep(TrainingContract, pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.dit = DiT(8, 2, 4, hidden_size=32, depth=2, num_heads=2, num_classes=10)

        def training_step(self, batch, batch_idx):
            t = torch.randint(0, 1000, (batch["latent"].shape[0],))
            out = self.dit(batch["latent"], t, {"y": batch["y"]})
            return out.float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Latents(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {"latent": torch.randn(4, 8, 8), "y": torch.tensor(i % 10)}

    module = DiTStep()
    throughput = Throughput(peak_flops=PEAK)
    fit(module, [throughput], DataLoader(Latents(), batch_size=3), max_steps=2)
    latent, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 2, 3])
    t = torch.tensor([5, 500, 999])
    expected = count(lambda: module.dit(latent, t, {"y": y}).float().square().mean().backward())
    assert throughput.flops_per_image == {(("latent", (4, 8, 8)), ("y", ())): expected / 3}


class TwoSizes(Dataset):
    """Batches of 8x8 and 16x16 images in turn (as aspect buckets give), batch size 2."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        size = 8 if (index // 2) % 2 == 0 else 16
        g = torch.Generator().manual_seed(index)
        return {"image": torch.rand(3, size, size, generator=g), "caption": str(index)}


def test_one_count_per_shape_mfu_from_an_injected_peak_and_accumulated_images(fit):
    throughput = Throughput(peak_flops=PEAK, log_every_n_steps=1, warmup_steps=0)
    loader = DataLoader(TwoSizes(), batch_size=2)
    fit(TinyDiffusion(), [throughput], loader, max_steps=4, accumulate_grad_batches=2)
    small, large = (("image", (3, 8, 8)),), (("image", (3, 16, 16)),)
    # Convolutions cost per pixel: 4x the pixels, 4x the FLOPs.
    assert throughput.flops_per_image[large] == 4 * throughput.flops_per_image[small]
    assert len(throughput.flops_per_image) == 2
    # 4 optimizer steps of 2 micro-batches of 2 images; the two counted micro-batches are left
    # out of the timing: 12 images timed.
    assert sum(w.images for w in throughput.windows) == 12
    # Each step has a batch of each size (step 1, both counted, has no window).
    per_image = (throughput.flops_per_image[small] + throughput.flops_per_image[large]) / 2
    assert [w.step for w in throughput.windows] == [2, 3, 4]
    for window in throughput.windows:
        assert window.mfu == pytest.approx(per_image * window.images_per_s / PEAK, rel=1e-6)
        assert window.images_per_s > 0 and 0 <= window.data_wait < 1


class SlowImages(RandomImages):
    def __init__(self, length: int, delay: float):
        super().__init__(length)
        self.delay = delay

    def __getitem__(self, index):
        time.sleep(self.delay)
        return super().__getitem__(index)


def data_wait(fit, delay: float) -> tuple[str, float]:
    throughput = Throughput(peak_flops=PEAK, warmup_steps=0)
    fit(TinyDiffusion(), [throughput], DataLoader(SlowImages(6, delay), batch_size=2), max_steps=3)
    return throughput.report(), throughput.windows[-1].data_wait


def test_data_wait_rises_when_the_data_is_slow(fit):
    _, fast = data_wait(fit, 0.0)
    report, slow = data_wait(fit, 0.1)  # 0.2 s per batch: far longer than a step
    assert slow > fast + 0.2, (slow, fast)
    assert f"data wait: {100 * slow:.1f} %" in report


def test_report_progress_bar_and_epoch_line(fit, capsys, caplog):
    throughput = Throughput(log_every_n_steps=2, warmup_steps=2, peak_flops=PEAK)
    bar = SmoothedProgressBar(log_every_n_steps=2, interactive=False)
    loader = DataLoader(RandomImages(8), batch_size=2)
    with caplog.at_level("INFO"):
        fit(TinyDiffusion(), [throughput, bar, EpochStats()], loader, max_steps=6)
    err = capsys.readouterr().err
    log = caplog.text
    last = throughput.windows[-1]
    line = [x for x in err.splitlines() if x.startswith("step 6/6")][0]
    assert f"{last.images_per_s:.1f} img/s | mfu {100 * last.mfu:.1f}%" in line
    assert log.count("throughput report:") == 1
    timed = [w for w in throughput.windows if not w.warmup]
    assert [w.step for w in timed] == [4, 6]
    images_per_s = sum(w.images for w in timed) / sum(w.seconds for w in timed)
    assert "steps 3-6, 1 device, 32-true" in log
    assert f"images/s: {images_per_s:.1f} mean" in log
    assert "of 1 GFLOP/s per device (given)" in log
    assert "FLOPs per image, image 3x8x8: 1.38e+05 FLOP" in log  # see the linear model's count
    assert "epoch 0: " in log and "MFU " in log.split("epoch 0: ")[1].splitlines()[0]
    assert "(process peak RSS)" in log


def test_flops_line_names_the_images_not_the_size_vectors():
    # The data writes SDXL's size and crop vectors for every model; an SD 1.x run's report
    # named them in its FLOPs line as if they set the cost.
    batch = {
        "image": torch.zeros(4, 3, 64, 64),
        "caption": ["a"] * 4,
        "original_size_as_tuple": torch.zeros(4, 2),
        "crop_coords_top_left": torch.zeros(4, 2),
        "loss_weight": torch.ones(4),
    }
    assert describe_shape(shape_key(batch)) == "image 3x64x64"
    cached = {"latent": torch.zeros(4, 8, 8, 8), "context": torch.zeros(4, 77, 32)}
    assert describe_shape(shape_key(cached)) == "latent 8x8x8, context 77x32"
    assert describe_shape(shape_key({"x": torch.zeros(4, 10)})) == "x 10"


def test_peaks_come_from_the_table_or_a_probe():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert table_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak_flops("NVIDIA H200 NVL", "tf32") == 417.5e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert table_peak_flops("AMD Instinct MI250X/MI250", "bf16") == 191.5e12
    assert table_peak_flops("NVIDIA GeForce RTX 3090 Ti", "bf16") is None  # not a 3090
    assert table_peak_flops("Some New Accelerator", "bf16") is None
    assert training_dtype("bf16-mixed") == training_dtype("bf16-true") == "bf16"
    assert training_dtype("16-mixed") == "fp16" and training_dtype("64-true") == "fp64"
    assert training_dtype("32-true") == "fp32"  # torch's default matmul precision: no TF32
    cpu = torch.device("cpu")
    first = measured_matmul_flops(cpu, torch.float32, budget_s=0.02)
    assert first > 1e6
    assert measured_matmul_flops(cpu, torch.float32) == first  # measured once per process


def test_on_by_default_and_off_in_the_config(tmp_path):
    run = RunDir(tmp_path / "run")

    def built(callbacks_config: dict) -> list:
        config = {"callbacks": callbacks_config, "logger": False}
        return [c for c in build_callbacks(config, run, False, False) if isinstance(c, Throughput)]

    assert len(built({})) == 1
    assert built({"throughput": None}) == []
    (custom,) = built({"throughput": {"params": {"peak_flops": 2.0e14, "warmup_steps": 3}}})
    assert custom.peak_flops == 2.0e14 and custom.warmup_steps == 3


def test_a_training_run_logs_the_figures_to_tensorboard(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    names = ("img_per_s", "mfu", "data_wait", "peak_mem_gb")
    assert {f"throughput/{name}" for name in names} <= tags
    (mfu,) = events.Scalars("throughput/mfu")  # step 1 was counted, step 2 timed
    assert mfu.step == 2 and mfu.value > 0  # against a CPU peak measured on a busy machine


DDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Subset
from callback_testing import RandomImages, TinyDiffusion
from lun.callbacks.throughput import Throughput

rank = int(os.environ["RANK"])
batch = 2 + rank  # ranks with batches of different sizes: the real sizes count
data = DataLoader(Subset(RandomImages(40), range(20 * rank, 20 * rank + 20)), batch_size=batch)
throughput = Throughput(log_every_n_steps=1, warmup_steps=0, peak_flops=1e9)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    use_distributed_sampler=False, callbacks=[throughput])
trainer.fit(TinyDiffusion(), data)
import torch.distributed
torch.distributed.destroy_process_group()  # as main.py does: gloo can abort at exit otherwise
with open(sys.argv[2] + f"/rank{rank}.json", "w") as f:
    json.dump([[w.images, w.images_per_s, w.mfu] for w in throughput.windows], f)
"""


@pytest.mark.slow
def test_under_ddp_images_are_global_and_the_report_is_printed_once(tmp_path):
    output = run_two_ranks(DDP_SCRIPT, tmp_path, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank has the gathered figures
    # Steps 2-4 are timed (step 1 was counted): 2 + 3 images per step over the two ranks.
    assert [images for images, _, _ in ranks[0]] == [5, 5, 5]
    flops_per_image = 138240  # TinyDiffusion at 8x8 (see the report test)
    for _, images_per_s, mfu in ranks[0]:
        assert mfu == pytest.approx(flops_per_image * images_per_s / (2 * 1e9), rel=1e-6)
    assert output.count("throughput report:") == 1
    assert "2 devices" in output


class SlowAfterStep(pl.Callback):
    """A callback that takes 0.1 s after every step (as a slow EMA update would)."""

    def __init__(self):
        self.ends = []  # when each step ended (before the sleep)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        time.sleep(0.1)


def test_time_spent_by_other_callbacks_after_a_step_is_no_data_wait(fit):
    throughput = Throughput(peak_flops=PEAK, warmup_steps=0, log_every_n_steps=10)
    loader = DataLoader(RandomImages(12), batch_size=2)
    slow = SlowAfterStep()
    fit(TinyDiffusion(), [throughput, slow], loader, max_steps=6)
    window = throughput.windows[-1]  # steps 2-6 (step 1 is counted, not timed): 5 x 0.1 s slept
    # The callback's time is the run's time (img/s includes it): the window spans the wall time
    # from the end of step 1 to the end of step 6, sleeps included.
    assert window.seconds == pytest.approx(slow.ends[-1] - slow.ends[0], rel=0.05)
    waited = window.data_wait * window.seconds
    assert waited < 0.25, window  # but it is not waiting for data (counted, it would be >= 0.5)


def test_mfu_is_never_shown_above_100_percent(fit, capsys, caplog):
    # A peak far below what the step achieves (a wrong `peak_flops`): "unknown", not 10^5 %.
    throughput = Throughput(peak_flops=1.0, log_every_n_steps=2, warmup_steps=0)
    bar = SmoothedProgressBar(log_every_n_steps=2, interactive=False)
    with caplog.at_level("INFO"):
        fit(TinyDiffusion(), [throughput, bar], DataLoader(RandomImages(8), batch_size=2))
    assert throughput.windows and all(w.mfu is None for w in throughput.windows)
    assert "MFU: unknown of 1 FLOP/s per device (given)" in caplog.text
    assert "| mfu ?" in capsys.readouterr().err


def test_a_probe_that_read_low_is_taken_again(fit, monkeypatch):
    from lun.callbacks import throughput as module

    # A loaded CPU's probe: 1 kFLOP/s, far below what the step itself achieves.
    monkeypatch.setitem(module._MEASURED_PEAKS, ("cpu", torch.float32), 1e3)
    throughput = Throughput(log_every_n_steps=2, warmup_steps=0)
    fit(TinyDiffusion(), [throughput], DataLoader(RandomImages(8), batch_size=2))
    assert throughput.peak_flops > 1e6  # probed again: the best of the probes
    assert all(w.mfu is not None and 0 < w.mfu <= 1 for w in throughput.windows)


class FourthItemLarger(RandomImages):
    """The fourth item twice the size: a new shape (an aspect bucket's), FLOP-counted, not timed."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if index == 3:
            item["image"] = item["image"].repeat(1, 2, 2)
        return item


def test_the_last_partial_window_is_gathered_even_when_this_rank_timed_none_of_it(fit, monkeypatch):
    """The figures are a collective: whether the run's last window is gathered must follow the
    steps, which all ranks share - not this rank's own timing, which a last step of a new shape
    leaves at zero here while another rank may have timed its step (it would wait in the gather
    for ever)."""
    gathered = []  # (step, the window's tally?, its busy seconds)
    figures = Throughput._figures

    def recorded(self, trainer, pl_module, tally, warmup):
        gathered.append((trainer.global_step, tally is self._window, tally.busy_s))
        return figures(self, trainer, pl_module, tally, warmup)

    monkeypatch.setattr(Throughput, "_figures", recorded)
    throughput = Throughput(log_every_n_steps=3, warmup_steps=0, peak_flops=PEAK)
    loader = DataLoader(FourthItemLarger(8), batch_size=1)
    fit(TinyDiffusion(), [throughput], loader, max_steps=4)
    windows = [(step, busy) for step, is_window, busy in gathered if is_window]
    assert windows[0][0] == 3 and windows[0][1] > 0  # the logged window, timed
    assert windows[1:] == [(4, 0.0)]  # the last one: untimed here, and gathered all the same
