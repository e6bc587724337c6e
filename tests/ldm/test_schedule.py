"""Noise schedules: original SD buffer values, diffusers' betas, zero terminal SNR, SNR."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.schedulers.scheduling_ddpm import betas_for_alpha_bar
from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr as diffusers_rescale

from ldm.schedule import (
    SCHEDULE_BUFFER_NAMES,
    make_betas,
    rescale_zero_terminal_snr,
    schedule_buffers,
    snr,
)

REFERENCE = Path(__file__).resolve().parents[1] / "reference"


def test_buffers_match_original_checkpoint_values():
    reference = json.loads((REFERENCE / "sd_v1_keys.json").read_text())
    first_last = reference["schedule_buffer_values_first_last"]
    buffers = schedule_buffers(make_betas("linear", 1000, 0.00085, 0.012))
    assert set(buffers) == set(first_last) == set(SCHEDULE_BUFFER_NAMES)
    for name, buffer in buffers.items():
        assert buffer.dtype == torch.float32 and list(buffer.shape) == reference["keys"][name]
        got = torch.stack([buffer[0], buffer[-1]])
        torch.testing.assert_close(got, torch.tensor(first_last[name]), rtol=1e-6, atol=0, msg=name)


def test_buffers_are_consistent_over_the_whole_schedule():
    buffers = schedule_buffers(make_betas())
    abar, abar_prev = buffers["alphas_cumprod"], buffers["alphas_cumprod_prev"]
    torch.testing.assert_close(abar_prev[1:], abar[:-1])
    torch.testing.assert_close(buffers["sqrt_alphas_cumprod"] ** 2, abar)
    torch.testing.assert_close(buffers["sqrt_recipm1_alphas_cumprod"] ** 2, 1 / abar - 1)
    # Noise-free chain (eps = 0): the posterior mean of q(x_{t-1} | x_t, x_0) (Ho et al. eq. 7) must
    # give x_{t-1} = sqrt(abar_{t-1}) x_0 from x_0 and x_t = sqrt(abar_t) x_0.
    torch.testing.assert_close(
        buffers["posterior_mean_coef1"] + buffers["posterior_mean_coef2"] * abar.sqrt(),
        abar_prev.sqrt(),
    )
    # posterior variance = 1 / (1 / (1 - abar_{t-1}) + alpha_t / beta_t), 0 at t = 0.
    betas = buffers["betas"]
    torch.testing.assert_close(
        buffers["posterior_variance"][1:],
        1 / (1 / (1 - abar_prev[1:]) + (1 - betas[1:]) / betas[1:]),
    )
    assert buffers["posterior_variance"][0] == 0


def test_linear_schedule_matches_diffusers_scaled_linear():
    diffusers = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    betas = make_betas("linear")
    assert betas.dtype == torch.float64 and betas.shape == (1000,)
    assert torch.equal(make_betas("scaled_linear"), betas)
    torch.testing.assert_close(betas.float(), diffusers.betas, rtol=1e-6, atol=0)
    # diffusers accumulates the product in float32; ours is float64 then cast.
    abar = schedule_buffers(betas)["alphas_cumprod"]
    torch.testing.assert_close(abar, diffusers.alphas_cumprod, rtol=2e-5, atol=0)


def test_cosine_schedule_is_diffusers_squaredcos_cap_v2():
    betas = make_betas("cosine", 1000)
    assert torch.equal(make_betas("squaredcos_cap_v2", 1000), betas)
    torch.testing.assert_close(betas, betas_for_alpha_bar(1000).double(), rtol=1e-5, atol=1e-7)
    assert betas.max() <= 0.999 and betas.min() >= 0


def test_sqrt_linear_is_diffusers_linear_and_unknown_name_fails():
    diffusers = DDPMScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear")
    betas = make_betas("sqrt_linear", 1000, 0.0001, 0.02)
    torch.testing.assert_close(betas.float(), diffusers.betas)
    expected_sqrt = torch.linspace(0.01, 0.04, 10, dtype=torch.float64).sqrt()
    torch.testing.assert_close(make_betas("sqrt", 10, 0.01, 0.04), expected_sqrt)
    with pytest.raises(ValueError, match="unknown beta schedule 'quadratic'"):
        make_betas("quadratic")


def test_zero_terminal_snr_rescale():
    betas = make_betas()
    rescaled = rescale_zero_terminal_snr(betas)
    assert rescaled.dtype == torch.float64
    abar, abar_rescaled = torch.cumprod(1 - betas, 0), torch.cumprod(1 - rescaled, 0)
    assert abar_rescaled[-1] == 0 and rescaled[-1] == 1
    torch.testing.assert_close(abar_rescaled[0], abar[0])
    torch.testing.assert_close(
        rescaled.float(), diffusers_rescale(betas.float()), atol=1e-6, rtol=1e-4
    )
    buffers = schedule_buffers(rescaled)
    assert buffers["alphas_cumprod"][-1] == 0
    assert buffers["alphas_cumprod"][0] == schedule_buffers(betas)["alphas_cumprod"][0]
    assert snr(buffers["alphas_cumprod"])[-1] == 0


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_snr_is_decreasing(schedule):
    abar = schedule_buffers(make_betas(schedule))["alphas_cumprod"].double()
    ratio = snr(abar)
    torch.testing.assert_close(ratio, abar / (1 - abar))
    assert (ratio[1:] < ratio[:-1]).all()
    torch.testing.assert_close(ratio[0], abar[0] / (1 - abar[0]))
