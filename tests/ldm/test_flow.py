"""Rectified flow (ldm/flow.py) against statements we did not write: diffusers' SD3 schedulers
(FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler), the paper's equations (Esser
et al. 2024, arXiv:2403.03206) and hand-computed values."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler

from ldm import flow


def velocity_field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A made-up velocity network, nonlinear in x and t: t (B,) in [0, 1]."""
    t = t.view(-1, 1, 1, 1)
    return torch.tanh(x) * (1 + t) + torch.sin(3 * t) - 0.5 * x * t**2


def test_noising_and_target_hand_computed():
    x0 = torch.tensor([[[[1.0, -2.0]]], [[[0.0, 3.0]]]])  # (2, 1, 1, 2)
    noise = torch.tensor([[[[0.5, 4.0]]], [[[2.0, -1.0]]]])
    t = torch.tensor([0.25, 1.0])
    # sample 0: 0.75 * x0 + 0.25 * e; sample 1 (t = 1): pure noise
    expected = torch.tensor([[[[0.875, -0.5]]], [[[2.0, -1.0]]]])
    assert torch.equal(flow.noised(x0, noise, t), expected)
    assert torch.equal(flow.velocity(x0, noise), torch.tensor([[[[-0.5, 6.0]]], [[[2.0, -4.0]]]]))


def test_velocity_is_the_time_derivative_of_the_path():
    """v = d x_t / dt (the flow matching target, eq. 1), by central differences of x_t."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    t, h = torch.tensor([0.3, 0.7], dtype=torch.float64), 1e-4
    x0, noise = x0.double(), noise.double()
    derivative = (flow.noised(x0, noise, t + h) - flow.noised(x0, noise, t - h)) / (2 * h)
    torch.testing.assert_close(flow.velocity(x0, noise), derivative)


def test_shift_is_the_papers_log_snr_offset():
    """Sec. 5.3.2: the shift keeps the SNR of the larger image equal: log SNR(t') = log SNR(t) -
    2 log(shift), with SNR(t) = ((1 - t) / t)^2 for x_t = (1 - t) x_0 + t e."""
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    for shift in (3.0, 0.5):
        shifted = flow.shift_time(t, shift)

        def log_snr(u):
            return 2 * torch.log((1 - u) / u)

        torch.testing.assert_close(log_snr(shifted), log_snr(t) - 2 * math.log(shift))
    assert flow.shift_time(torch.tensor(0.5), 3.0) == 0.75  # 1.5 / 2: toward noise


def test_logit_normal_against_its_closed_form():
    """t = sigmoid(u), u ~ N(m, s) (eq. 19): the q-quantile of t is sigmoid(m + s Phi^-1(q))."""
    m, s = 0.5, 0.8
    t = flow.logit_normal(200_000, m, s, torch.Generator().manual_seed(0))
    assert 0 < t.min() and t.max() < 1
    normal = torch.distributions.Normal(0.0, 1.0)
    for q in (0.1, 0.5, 0.9):
        expected = torch.sigmoid(m + s * normal.icdf(torch.tensor(q)))
        assert abs(torch.quantile(t[:100_000], q) - expected) < 5e-3, q


def test_mode_sampling_hand_computed_quantiles():
    """f_mode(u; s) = 1 - u - s (cos^2(pi u / 2) - 1 + u) decreases in u (eq. 20), so the
    (1 - u)-quantile of t is f_mode(u): by hand, f(0.5; 1) = 0.5, f(0.25; 1) = 0.646447."""
    t = flow.mode_heavy_tails(200_000, 1.0, torch.Generator().manual_seed(0))
    assert abs(torch.quantile(t[:100_000], 0.5) - 0.5) < 5e-3
    assert abs(torch.quantile(t[:100_000], 0.75) - 0.646447) < 5e-3


def test_schedule_draws_shifted_times_and_checks_its_keys():
    schedule = flow.FlowSchedule(timestep_sampling="uniform", shift=3.0)
    t = schedule.sample_t(100_000, torch.Generator().manual_seed(0))
    # uniform u shifted: P(t' <= 0.75) = P(u <= 0.5) = 0.5
    assert abs((t <= 0.75).float().mean() - 0.5) < 5e-3
    with pytest.raises(ValueError, match="timestep_sampling"):
        flow.FlowSchedule(timestep_sampling="lognorm")
    with pytest.raises(ValueError, match="shift"):
        flow.FlowSchedule(shift=0)


@pytest.mark.parametrize("steps,shift", [(28, 3.0), (7, 1.0), (4, 2.5)])
def test_sigmas_equal_diffusers_sd3_scheduler(steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    ours = flow.flow_sigmas(steps, shift)
    torch.testing.assert_close(ours, scheduler.sigmas.float())
    torch.testing.assert_close(ours[:-1] * 1000, scheduler.timesteps.float())


@pytest.mark.parametrize("shift", [3.0, 1.0])
def test_euler_trajectory_equals_diffusers_step(shift):
    """The same velocities through diffusers' `step()` and through our sampler, step by step; the
    network sees diffusers' timesteps (t * 1000)."""
    steps = 6
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    theirs, x = [], noise
    for timestep in scheduler.timesteps:
        v = velocity_field(x, (timestep / 1000).expand(2))
        x = scheduler.step(v, timestep, x).prev_sample
        theirs.append(x)

    ours, seen = [], []

    def network(x, t, cond):
        seen.append(t[0].item())
        return velocity_field(x, t / 1000)

    final = flow.sample(
        network,
        noise,
        sampler="euler",
        steps=steps,
        shift=shift,
        cond={},
        callback=lambda info: ours.append(info["x"]),
    )
    torch.testing.assert_close(torch.tensor(seen), scheduler.timesteps.float())
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, theirs[-1], rtol=1e-5, atol=1e-5)


def test_heun_equals_diffusers_heun_scheduler():
    steps, shift = 5, 3.0
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    scheduler = FlowMatchHeunDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    x = noise
    for timestep in scheduler.timesteps:
        x = scheduler.step(velocity_field(x, (timestep / 1000).expand(1)), timestep, x).prev_sample
    calls = []

    def network(x, t, cond):
        calls.append(t)
        return velocity_field(x, t / 1000)

    ours = flow.sample(network, noise, sampler="heun", steps=steps, shift=shift, cond={})
    assert len(calls) == len(scheduler.timesteps)  # 2 per step, the last (to t = 0) Euler
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)


def test_euler_is_exact_for_a_perfect_straight_flow():
    """A network that knows x_0 predicts v = (x - x_0) / t exactly on the straight path: every
    Euler step stays on it and lands on x_0 (rectified flow's point, sec. 2)."""
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)

    def network(x, t, cond):
        return (x - x0) / (t / 1000).view(-1, 1, 1, 1)

    out = flow.sample(network, noise, steps=3, shift=3.0, cond={})
    torch.testing.assert_close(out, x0, rtol=1e-4, atol=1e-4)


def test_guidance_extrapolates_the_velocity():
    """CFG on the velocity: v = v_u + s (v_c - v_u) (Ho & Salimans 2022 eq. 6), one Euler step."""
    noise = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(4))

    def network(x, t, cond):
        return x * cond["y"].view(-1, 1, 1, 1)

    cond, uncond = {"y": torch.tensor([3.0])}, {"y": torch.tensor([1.0])}
    out = flow.sample(network, noise, steps=1, cond=cond, uncond=uncond, scale=2.0)
    # one step from t = 1 to 0: x - (1 + 2 (3 - 1)) x = -4 x
    torch.testing.assert_close(out, -4 * noise)


def test_img2img_starts_where_diffusers_sd3_img2img_does():
    """diffusers' SD3 img2img runs the last int(steps * strength) timesteps and noises the image
    as sigma e + (1 - sigma) x_0 (`scale_noise`)."""
    steps, strength, shift = 8, 0.75, 3.0  # runs 6 of 8: starts at the 3rd
    g = torch.Generator().manual_seed(5)
    init, noise = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, 4, 4, 4, generator=g)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    start = steps - int(steps * strength)
    first = scheduler.timesteps[start : start + 1]
    expected_x = scheduler.scale_noise(init, first, noise)
    seen = []

    def network(x, t, cond):
        seen.append((x.clone(), t.clone()))
        return torch.zeros_like(x)

    flow.sample(
        network, noise, steps=steps, shift=shift, cond={}, init_latent=init, strength=strength
    )
    assert len(seen) == int(steps * strength)
    torch.testing.assert_close(seen[0][1], first.float())
    torch.testing.assert_close(seen[0][0], expected_x)


def test_unknown_sampler_is_one_clear_error():
    with pytest.raises(ValueError, match="flow sampler"):
        flow.sample(lambda x, t, c: x, torch.zeros(1, 1, 2, 2), sampler="dpmpp_2m", cond={})
