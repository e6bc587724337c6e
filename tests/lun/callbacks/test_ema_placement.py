"""`EMA(shadows=host|device|auto)`: where the shadows live, counted there by the memory plan
(lun.memory), "auto" placed on the device only when the device's peak with them fits its budget;
on a CPU-only run every choice trains the same average, bit for bit."""

import lightning.pytorch as pl
import pytest
import torch
from callback_testing import TinyDiffusion

from lun import strategies
from lun.callbacks.ema import EMA
from lun.config import ConfigError
from lun.memory import _ema_parts, _precision, place_ema
from lun.memory_parts import ACTIVATIONS, DEVICE, EMA_STAGING, HOST, GiB, MemoryPlan, Part
from lun.run import RunDir
from lun.trainer import build_callbacks


def test_a_bad_place_is_one_line_naming_the_key(tmp_path):
    lightning = {"callbacks": {"ema": {"params": {"shadows": "gpu"}}}}
    with pytest.raises(ConfigError) as err:
        build_callbacks(lightning, RunDir(tmp_path), has_validation=False, use_ema=True)
    assert str(err.value) == (
        "lightning.callbacks.ema.params.shadows='gpu': expected one of host, device, auto"
    )


@pytest.mark.parametrize("shadows", ["device", "auto"])
def test_on_the_cpu_every_place_trains_the_same_average(shadows, make_module, make_loader, fit):
    averages = []
    for place in ("host", shadows):
        torch.manual_seed(0)
        ema = EMA(decay=0.9, shadows=place)
        fit(make_module(), [ema], make_loader(), max_steps=3)
        assert all(s.device.type == "cpu" for s in ema.shadows.values())
        averages.append(ema.shadows)
    host, other = averages
    assert host.keys() == other.keys()
    assert all(torch.equal(host[name], other[name]) for name in host)


def plan(device_budget: int | None, device: str = "cuda:0") -> MemoryPlan:
    """6 GiB of weights and 2 of activations on the device, 3 GiB of shadows and staging."""
    parts = [
        Part("weights", 6 * GiB, DEVICE),
        Part(ACTIVATIONS, 2 * GiB, DEVICE),
        Part("EMA", 3 * GiB, HOST),
        Part(EMA_STAGING, 3 * GiB, HOST),
    ]
    return MemoryPlan(parts, device, host_budget=64 * GiB, device_budget=device_budget)


def ema_place(made: MemoryPlan) -> str:
    return next(p.place for p in made.parts if p.name == "EMA")


@pytest.mark.parametrize(
    "budget, on_device",
    [
        (11 * GiB, True),  # 6 + 2 + 3 = 11 GiB: just fits
        (11 * GiB - 1, False),
        (None, False),  # budget unknown: host RAM
    ],
)
def test_auto_puts_the_shadows_on_the_device_when_they_fit(budget, on_device):
    made, ema = plan(budget), EMA(shadows="auto")
    host_before = made.peak(HOST)
    place_ema(made, ema)
    assert ema.on_device is on_device
    assert ema_place(made) == (DEVICE if on_device else HOST)
    assert made.peak(DEVICE) == (11 if on_device else 8) * GiB
    assert made.peak(HOST) == host_before - (3 * GiB if on_device else 0)


def test_auto_on_a_cpu_run_and_fixed_places_are_left_alone():
    made, ema = plan(64 * GiB, device="cpu"), EMA(shadows="auto")
    place_ema(made, ema)
    assert ema.on_device is False and ema_place(made) == HOST
    for shadows, on_device in (("host", False), ("device", True)):
        made, ema = plan(64 * GiB), EMA(shadows=shadows)
        place_ema(made, ema)
        assert ema.on_device is on_device and ema_place(made) == HOST  # not the plan's to move


@pytest.mark.parametrize("planned, on_device", [(None, False), (True, True), (False, False)])
def test_auto_takes_rank_0s_plan_and_no_plan_means_host_ram(planned, on_device):
    ema = EMA(shadows="auto")
    ema.on_device = planned  # what place_ema decided on rank 0 (None: no plan was made)
    trainer = pl.Trainer(accelerator="cpu", callbacks=[ema], logger=False)
    ema.setup(trainer, Linear(), "fit")
    ema.teardown(trainer, Linear(), "fit")
    assert ema.on_device is on_device


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(100, 50)

    @property
    def ema_module(self):
        return self.net


@pytest.mark.parametrize("shadows, place", [("host", HOST), ("device", DEVICE)])
def test_the_plan_counts_the_shadows_where_they_live(shadows, place):
    trainer = pl.Trainer(accelerator="cpu", callbacks=[EMA(shadows=shadows)], logger=False)
    precision = _precision(trainer, strategies.sharding(trainer.strategy, 1, 1))
    shadows_part, staging = _ema_parts(trainer, Linear(), precision)
    assert (shadows_part.name, shadows_part.nbytes, shadows_part.place) == (
        "EMA",
        (100 * 50 + 50) * 4,  # fp32
        place,
    )
    assert (staging.name, staging.place) == (EMA_STAGING, HOST)  # for swaps, in host RAM


def test_the_device_tests_model_computes_its_loss_on_the_batchs_device():
    """On the meta device, as on an accelerator, no CPU tensor may mix into the loss."""
    images = torch.rand(2, 3, 8, 8, device="meta")
    assert TinyDiffusion().to("meta").diffusion_loss(images).device == images.device


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_on_an_accelerator_device_shadows_live_there_and_average_the_same(
    make_loader, fit, monkeypatch
):
    # deterministic convolution kernels: the two runs train the same weights, so the averages
    # differ only by where the fold ran
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    averages = {}
    for place in ("host", "device"):
        torch.manual_seed(0)
        ema = EMA(decay=0.9, shadows=place)
        module = TinyDiffusion()
        fit(module, [ema], make_loader(), max_steps=3, accelerator="auto")
        ema._finish()
        devices = {s.device.type for s in ema.shadows.values()}
        assert devices == (
            {"cpu"} if place == "host" else {torch.accelerator.current_accelerator().type}
        )
        averages[place] = {n: s.cpu() for n, s in ema.shadows.items()}
    for name, shadow in averages["host"].items():  # the same fold, on the CPU or the device
        torch.testing.assert_close(averages["device"][name], shadow)
