"""`lightning.trainer.gradient_clip_val` under FSDP: Lightning's FSDP precision plugin refuses
clipping by norm, so lun.trainer hands it to `FSDPGradientClipping` (FSDP's own
`clip_grad_norm_`), which must clip as Lightning's plain clipping (`torch.nn.utils.
clip_grad_norm_`) does on one device. FSDP runs here in-process on one CPU rank (gloo): no fork."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import quiet_trainer

from lun.config import ConfigError, merge_configs
from lun.run import RunDir
from lun.trainer import FSDPGradientClipping, build_trainer, fsdp_clipping, trainer_kwargs

FSDP = {"target": "lun.strategies.FSDPStrategy"}
MAX_NORM = 0.5


class TwoLayers(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return (self.net(batch[0]) ** 2).mean() * 100  # a gradient norm well over MAX_NORM

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def one_step(**kwargs) -> dict[str, torch.Tensor]:
    """The weights after one SGD step of TwoLayers under Trainer `kwargs`."""
    model = TwoLayers()
    # One batch of all 4 items, in the loader's order: Lightning would give FSDP a shuffled
    # DistributedSampler (seeded by PL_GLOBAL_SEED) and the plain run none.
    items = TensorDataset(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))
    data = DataLoader(items, batch_size=4)
    trainer = quiet_trainer(devices=1, max_steps=1, use_distributed_sampler=False, **kwargs)
    was_initialized = torch.distributed.is_initialized()
    try:
        trainer.fit(model, data)
    finally:  # FSDP's one-rank gloo group stays after fit: not for the tests that follow
        if torch.distributed.is_initialized() and not was_initialized:
            torch.distributed.destroy_process_group()
    return {name: p.detach().clone() for name, p in model.net.named_parameters()}


def test_fsdp_clips_by_norm_as_lightning_does_on_one_device():
    kwargs = trainer_kwargs({"strategy": FSDP, "trainer": {"gradient_clip_val": MAX_NORM}})
    clipping = fsdp_clipping(kwargs)
    assert isinstance(clipping, FSDPGradientClipping) and "gradient_clip_val" not in kwargs
    sharded = one_step(strategy=kwargs["strategy"], callbacks=[clipping])
    reference = one_step(gradient_clip_val=MAX_NORM)  # torch.nn.utils.clip_grad_norm_
    unclipped = one_step()
    for name, weight in reference.items():
        torch.testing.assert_close(sharded[name], weight)
    assert any(not torch.allclose(unclipped[n], w) for n, w in reference.items())  # it clipped


@pytest.mark.parametrize(
    "lightning",
    [
        {"trainer": {"gradient_clip_val": 1.0}},  # no strategy: Lightning clips
        {"strategy": "ddp", "trainer": {"gradient_clip_val": 1.0}},
        {
            "strategy": FSDP,
            "trainer": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
        },
        {"strategy": FSDP, "trainer": {"gradient_clip_val": 0}},
    ],
)
def test_only_fsdp_with_norm_clipping_moves_the_value(lightning):
    kwargs = trainer_kwargs(lightning)
    before = dict(kwargs)
    assert fsdp_clipping(kwargs) is None and kwargs == before


def test_a_bad_value_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:  # the config's check comes first (the test below)
        FSDPGradientClipping(-1.0)
    assert str(err.value) == (
        "lightning.trainer.gradient_clip_val=-1.0: expected a number > 0 (0 or null: no clipping)"
    )


@pytest.mark.parametrize("value", [-1, -0.5, "abc", True])
def test_a_clip_value_lightning_would_skip_is_refused_under_every_strategy(value):
    """Lightning clips nothing at a value <= 0 and says nothing: -1 would train unclipped."""
    with pytest.raises(ConfigError) as err:
        trainer_kwargs({"trainer": {"gradient_clip_val": value}})
    assert str(err.value).startswith(f"lightning.trainer.gradient_clip_val={value!r}: expected")


@pytest.mark.parametrize("value", [None, 0, 0.5, 1])
def test_clip_values_lightning_takes_pass(value):
    assert trainer_kwargs({"trainer": {"gradient_clip_val": value}})["gradient_clip_val"] == value


def test_the_shipped_fsdp_preset_on_a_clipping_config_builds_a_clipping_trainer(tmp_path):
    # configs/lightning/fsdp.yaml's own example: merged after v1-finetune.yaml (clip 1.0).
    configs = Path(__file__).resolve().parents[3] / "configs"
    cfg = merge_configs(
        [configs / "stable-diffusion/v1-finetune.yaml", configs / "lightning/fsdp.yaml"],
        ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=1"],
    )
    lightning = OmegaConf.to_container(cfg, resolve=True)["lightning"]
    trainer = build_trainer(lightning, RunDir(tmp_path), has_validation=False)
    assert trainer.gradient_clip_val is None  # Lightning's FSDP plugin would refuse it
    (clipping,) = [c for c in trainer.callbacks if isinstance(c, FSDPGradientClipping)]
    assert clipping.max_norm == 1.0
