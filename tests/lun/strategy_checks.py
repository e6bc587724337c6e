"""Helpers of tests/lun/test_strategies.py and test_strategy_numbers.py: one optimizer step of
the tiny LDM, and the tiny LDM with draws fixed in advance."""

from pathlib import Path

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

import ldm.diffusion
import ldm.objectives
from ldm.util import instantiate_from_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
SAMPLES = 4
LR = 0.5


class FixedDraws:
    """Stands in for `torch` inside `ldm.objectives` (where t and the noise are drawn): `randint`
    and `randn` hand out precomputed values in order, so each sample gets the same t and noise
    whether it is in one batch of 4 or in two micro-batches of 2. Everything else is torch's."""

    def __init__(self, t: torch.Tensor, noise: torch.Tensor):
        self.t, self.noise = t, noise
        self.t_used = self.noise_used = 0

    def randint(self, low, high, size, **kwargs):
        out = self.t[self.t_used : self.t_used + size[0]]
        self.t_used += size[0]
        return out

    def randn(self, size, **kwargs):
        out = self.noise[self.noise_used : self.noise_used + size[0]]
        self.noise_used += size[0]
        return out.to(kwargs.get("dtype") or out.dtype)

    def __getattr__(self, name):
        return getattr(torch, name)


def tiny_model(unet_params: dict | None = None, **params) -> ldm.diffusion.LatentDiffusion:
    """The tiny LDM with plain SGD (the update is then -lr x gradient) and overrides of its
    `params` and its UNet's."""
    config = OmegaConf.to_container(OmegaConf.load(TINY)["model"])
    config["params"]["unet_config"]["params"].update(unet_params or {})
    config["params"].update(
        optimizer_config={"target": "torch.optim.SGD", "params": {"weight_decay": 0.0}}, **params
    )
    torch.manual_seed(0)
    model = instantiate_from_config(config)
    model.learning_rate = LR
    return model


def latent_batches(batch_size: int) -> DataLoader:
    """SAMPLES cached latents with captions, in a fixed order."""
    generator = torch.Generator().manual_seed(1)
    items = [
        {"latent": torch.randn(4, 8, 8, generator=generator), "caption": f"a shape number {i}"}
        for i in range(SAMPLES)
    ]
    return DataLoader(items, batch_size=batch_size, shuffle=False)


def one_step(
    batch_size: int, accumulate: int, strategy="auto", precision="32-true", **model_params
) -> tuple[dict[str, torch.Tensor], float]:
    """Weights' change after ONE optimizer step over the 4 samples, and the logged train/loss."""
    generator = torch.Generator().manual_seed(2)
    draws = FixedDraws(
        torch.randint(0, 1000, (SAMPLES,), generator=generator),
        torch.randn(SAMPLES, 4, 8, 8, generator=generator),
    )
    model = tiny_model(**model_params)
    before = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    original_torch, ldm.objectives.torch = ldm.objectives.torch, draws
    try:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            precision=precision,
            max_steps=1,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, latent_batches(batch_size))
    finally:
        ldm.objectives.torch = original_torch
    after = dict(model.model.named_parameters())
    update = {n: (after[n].detach().float() - before[n]) for n in before}
    return update, float(trainer.callback_metrics["train/loss"])
