"""ldm.objectives: eps, v and rectified flow, each checked against the paper's formula written
out here (the schedule recomputed from SD's betas, never read from our buffers):

    q_sample   x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) e          (Ho et al. 2020, eq. 4)
    v          v = sqrt(abar_t) e - sqrt(1 - abar_t) x_0           (Salimans & Ho 2022, sec. 4)
    flow       x_t = (1 - t) x_0 + t e, target e - x_0, t = step/1000 (Esser et al. 2024, eq. 3)
    min-SNR    eps: min(SNR, g) / SNR, v: min(SNR, g) / (SNR + 1)   (Hang et al. 2023, eq. 10)

and the samplers' reading of the output: a stand-in that outputs the true eps / v / velocity of
a known x_0 must be sampled back to exactly that x_0 by a deterministic sampler."""

import pytest
import torch

from ldm import objectives

T = 1000


def sd_alphas_cumprod() -> torch.Tensor:
    """abar of SD's "linear" schedule: betas = linspace(sqrt(0.00085), sqrt(0.012), 1000)^2."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, T, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0)


def draws(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)


def run_loss(objective, z, noise, t, output):
    """The objective's loss with a stand-in backbone `output(x_t)`; returns (loss, x_t seen)."""
    seen = {}

    def model_fn(x_t, t_seen, cond):
        assert torch.equal(t_seen, t)
        seen["x_t"] = x_t
        return output(x_t)

    loss = objective.loss(model_fn, z, noise, t, {}, objective.schedule_buffers())
    return loss, seen["x_t"]


def col(values: torch.Tensor) -> torch.Tensor:
    return values.float().view(-1, 1, 1, 1)


@pytest.mark.parametrize("name", ["eps", "v"])
def test_ddpm_noising_is_q_sample_and_the_target_is_the_papers(name):
    z, noise = draws()
    t = torch.tensor([0, 499, 999])
    abar = sd_alphas_cumprod()[t]
    a, s = col(abar.sqrt()), col((1 - abar).sqrt())
    target = noise if name == "eps" else a * noise - s * z
    objective = objectives.build(name)
    # A backbone off the target by 0.1 everywhere: loss 0.01, only if target and sign are right.
    loss, x_t = run_loss(objective, z, noise, t, lambda x_t: target + 0.1)
    torch.testing.assert_close(x_t, a * z + s * noise)
    torch.testing.assert_close(loss, torch.full((3,), 0.01), rtol=1e-4, atol=1e-6)


def test_flow_noises_on_the_straight_path_and_targets_e_minus_x0():
    z, noise = draws()
    t = torch.tensor([100.0, 500.0, 975.0])  # the backbone's units: flow times 0.1, 0.5, 0.975
    objective = objectives.build("flow")
    loss, x_t = run_loss(objective, z, noise, t, lambda x_t: noise - z + 0.1)
    time = col(t / 1000)
    torch.testing.assert_close(x_t, (1 - time) * z + time * noise)
    torch.testing.assert_close(loss, torch.full((3,), 0.01), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["eps", "v"])
def test_min_snr_weights_are_hang_et_al_eq_10(name):
    z, noise = draws()
    t = torch.tensor([5, 300, 900])  # SNR above, near and below gamma = 5
    abar = sd_alphas_cumprod()[t]
    snr = abar / (1 - abar)
    assert snr[0] > 5 > snr[2]
    expected = snr.clamp(max=5.0) / (snr if name == "eps" else snr + 1)
    objective = objectives.build(name, {"min_snr_gamma": 5.0})
    target = objective.target(z, noise, t, objective.schedule_buffers())
    # Output error 1 everywhere: the per-sample loss is the weight itself.
    loss, _ = run_loss(objective, z, noise, t, lambda x_t: target + 1.0)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)


def test_ddpm_times_are_uniform_integer_steps():
    t = objectives.build("eps").sample_t(40_000, torch.Generator().manual_seed(0))
    assert t.dtype == torch.int64 and t.min() == 0 and t.max() == T - 1
    counts = torch.bincount(t // 100, minlength=10).double()  # each tenth: 4000 +- 4 sigma
    assert ((counts - 4000).abs() < 4 * 4000**0.5).all(), counts


@pytest.mark.parametrize(
    "schedule, below_half",
    [
        # uniform u shifted: t = s u / (1 + (s - 1) u) <= 1/2  <=>  u <= 1 / (s + 1) (sec. 5.3.2)
        ({"timestep_sampling": "uniform", "shift": 3.0}, 0.25),
        ({"timestep_sampling": "uniform"}, 0.5),
        # logit-normal(m, 1): t = sigmoid(u) <= 1/2  <=>  u <= 0: Phi(-m) (eq. 19); Phi(-1) =
        ({"timestep_sampling": "logit_normal", "logit_mean": 1.0}, 0.158655),
        # the mode density is symmetric about 1/2 for any scale (eq. 20)
        ({"timestep_sampling": "mode", "mode_scale": 1.29}, 0.5),
    ],
)
def test_flow_times_follow_the_papers_densities(schedule, below_half):
    objective = objectives.build("flow", {"schedule": schedule})
    t = objective.sample_t(40_000, torch.Generator().manual_seed(0))
    assert t.dtype == torch.float32 and 0 <= t.min() and t.max() <= T
    share = (t <= T / 2).double().mean().item()
    assert abs(share - below_half) < 0.01, share


def test_offset_noise_adds_one_draw_per_sample_and_channel():
    """Guttenberg 2023: e + offset * N(0, 1) of shape (B, C, 1, 1), after the pixel noise."""
    z = torch.zeros(2, 4, 8, 8)
    noise = objectives.build("v", {"offset_noise": 0.5}).draw_noise(
        z, torch.Generator().manual_seed(3)
    )
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(2, 4, 8, 8, generator=g)
    torch.testing.assert_close(noise, pixels + 0.5 * torch.randn(2, 4, 1, 1, generator=g))
    plain = objectives.build("v").draw_noise(z, torch.Generator().manual_seed(3))
    torch.testing.assert_close(plain, pixels)


@pytest.mark.parametrize(
    "name, sampler, learn_sigma",
    [("eps", "ddim", False), ("v", "ddim", False), ("flow", "euler", False), ("v", "ddim", True)],
)
def test_the_sampler_reads_the_output_as_the_objective_defines_it(name, sampler, learn_sigma):
    """A backbone that outputs the true eps / v / velocity of one fixed x_0 from any x_t: every
    DDIM step predicts exactly that x_0, and flow Euler lands on it. A learn_sigma backbone's
    variance half (here 5s) is not read by these samplers."""
    x0, noise = draws(1)
    abar = sd_alphas_cumprod()

    def oracle(x_t, t, cond):
        if name == "flow":
            return (x_t - x0) / col(t / 1000)  # e - x_0, with e = (x_t - (1 - t) x_0) / t
        a, s = col(abar[t].sqrt()), col((1 - abar[t]).sqrt())
        eps = (x_t - a * x0) / s
        out = eps if name == "eps" else a * eps - s * x0
        return torch.cat([out, torch.full_like(out, 5.0)], 1) if learn_sigma else out

    objective = objectives.build(name)
    if learn_sigma:
        objective = objectives.LearnedVariance(objective)
    denoised = []
    out = objective.sample(
        oracle,
        noise,
        objective.schedule_buffers(),
        sampler=sampler,
        steps=5,
        cond={"y": None},
        callback=lambda step: denoised.append(step.get("denoised")),
    )
    assert len(denoised) == 5
    if name == "flow":
        torch.testing.assert_close(out, x0, rtol=1e-4, atol=1e-4)
    else:
        for x0_predicted in denoised:
            torch.testing.assert_close(x0_predicted, x0, rtol=1e-4, atol=1e-4)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="parameterization must be 'eps', 'v' or 'flow'"):
        objectives.build("x0")
    with pytest.raises(ValueError, match=r"unknown keys \['min_snr'\]"):
        objectives.build("eps", {"min_snr": 5})
    with pytest.raises(ValueError, match="min_snr_gamma is a DDPM weighting"):
        objectives.build("flow", {"min_snr_gamma": 5})
    with pytest.raises(ValueError, match="learn_sigma"):
        objectives.LearnedVariance(objectives.build("flow"))
