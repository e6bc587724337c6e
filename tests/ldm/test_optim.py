import sys

import pytest
import torch

from ldm.optim import LambdaLinearScheduler, WarmupScheduler, build_optimizer, build_scheduler


def test_warmup_then_cosine_and_linear():
    cosine = WarmupScheduler("cosine", warmup_steps=10, total_steps=110, min_factor=0.1)
    assert cosine(0) == pytest.approx(0.1) and cosine(9) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cosine(110) == pytest.approx(0.1) and cosine(500) == pytest.approx(0.1)
    linear = WarmupScheduler("linear", warmup_steps=0, total_steps=100)
    assert linear(25) == pytest.approx(0.75)
    assert WarmupScheduler("constant", warmup_steps=4)(100) == 1.0
    with pytest.raises(ValueError, match="total_steps"):
        WarmupScheduler("cosine")


def test_original_lambda_linear_scheduler():
    """The values the original ldm.lr_scheduler.LambdaLinearScheduler gives for SD's config."""
    schedule = LambdaLinearScheduler(
        warm_up_steps=[100],
        f_min=[1.0],
        f_max=[1.0],
        f_start=[1e-6],
        cycle_lengths=[10_000_000_000_000],
    )
    assert schedule(0) == pytest.approx(1e-6)
    assert schedule(50) == pytest.approx(1e-6 + (1 - 1e-6) * 0.5)
    assert schedule(100) == pytest.approx(1.0) and schedule(10**6) == pytest.approx(1.0)


def test_scheduler_steps_per_optimizer_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], lr=1.0)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["weight_decay"] == 0.01
    assert optimizer.defaults["fused"]
    config = {
        "target": "ldm.optim.WarmupScheduler",
        "params": {"kind": "constant", "warmup_steps": 4},
    }
    scheduler = build_scheduler(optimizer, config)
    assert scheduler["interval"] == "step"
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler["scheduler"].step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_8bit_adamw_without_bitsandbytes_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        build_optimizer(
            [torch.nn.Parameter(torch.zeros(1))], lr=1e-4, config={"target": "adamw8bit"}
        )


def test_fused_adamw_steps_like_the_loop_and_can_be_turned_off():
    torch.manual_seed(0)
    start, grads = torch.randn(3, 5), [torch.randn(3, 5) for _ in range(4)]
    results = []
    for params in ({}, {"fused": False}):
        param = torch.nn.Parameter(start.clone())
        optimizer = build_optimizer([param], lr=1e-2, config={"target": "adamw", "params": params})
        assert bool(optimizer.defaults["fused"]) == (params == {})
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        results.append(param.detach())
    torch.testing.assert_close(results[0], results[1])


def test_parameters_without_a_fused_kernel_fall_back_to_the_default_adamw():
    fused = torch.nn.Parameter(torch.zeros(2))
    complex_valued = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    groups = [{"params": [fused]}, {"params": [complex_valued], "lr": 0.1}]
    optimizer = build_optimizer(groups, lr=1e-2)
    assert not optimizer.defaults["fused"]
    fused.grad, complex_valued.grad = torch.ones(2), torch.ones(2, dtype=torch.complex64)
    optimizer.step()
    assert (fused < 0).all() and (complex_valued.real < 0).all()


@pytest.mark.parametrize(
    "clip, precision, fused",
    [(1.0, "bf16-mixed", None), (0.0, "bf16-mixed", True), (1.0, "32-true", True)],
)
def test_adamw_is_not_fused_where_lightning_clips_under_mixed_precision(
    tiny_config, clip, precision, fused
):
    """Lightning's mixed-precision plugin refuses to clip for an optimizer that unscales itself."""
    from lightning.pytorch import Trainer

    from ldm.util import instantiate_from_config
    from lun.config import merge_configs, to_container

    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    trainer = Trainer(accelerator="cpu", gradient_clip_val=clip, precision=precision, logger=False)
    model.trainer = trainer
    optimizer = model.configure_optimizers()
    assert optimizer.defaults["fused"] is fused
