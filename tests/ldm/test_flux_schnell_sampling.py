"""FLUX.1 [schnell] samples on the unshifted grid, dev on the shifted one - BFL's rule, written
out here from its source: cli.py `get_schedule(num_steps, image_seq_len,
shift=(name != "flux-schnell"))`, sampling.py get_schedule: timesteps = linspace(1, 0,
num_steps + 1), and only with shift: mu = line through (256, 0.5), (4096, 1.15) at
image_seq_len, t <- exp(mu) / (exp(mu) + (1 / t - 1)). Read through the shipped configs."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm import objectives

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "flux"
STEPS, LATENT = 4, (128, 128)  # a 1024 px image: 64 x 64 patches = 4096 tokens


def bfl_schedule(num_steps: int, image_seq_len: int, shift: bool) -> list[float]:
    timesteps = [1 - i / num_steps for i in range(num_steps + 1)]
    if not shift:
        return timesteps
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (image_seq_len - 256)
    return [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t in timesteps]


def sampled_times(config: str) -> list[float]:
    """The times the config's objective calls the network at (Euler, v = 1), then the last 0."""
    schedule = OmegaConf.to_container(OmegaConf.load(CONFIGS / config).model.params.schedule)
    objective = objectives.build("flow", {"schedule": schedule})
    seen = []

    def network(x, t, cond):
        seen.append(float(t[0]) / objective.num_timesteps)
        return torch.ones_like(x)

    objective.sample(network, torch.zeros(1, 16, *LATENT), {}, steps=STEPS, cond={})
    return [*seen, 0.0]


@pytest.mark.parametrize(
    "config, name",
    [("flux1-schnell-lora.yaml", "flux-schnell"), ("flux1-dev-lora.yaml", "flux-dev")],
)
def test_the_configs_sample_as_bfl_cli(config, name):
    tokens = (LATENT[0] // 2) * (LATENT[1] // 2)
    expected = bfl_schedule(STEPS, tokens, shift=(name != "flux-schnell"))
    assert sampled_times(config) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_schnell_still_trains_on_the_shifted_times():
    """Only sampling is unshifted: the training draws keep the size-dependent shift."""
    schedule = OmegaConf.load(CONFIGS / "flux1-schnell-lora.yaml").model.params.schedule
    objective = objectives.build("flow", {"schedule": OmegaConf.to_container(schedule)})
    assert objective.times.shift_for(LATENT) == pytest.approx(math.exp(1.15), rel=1e-12)
