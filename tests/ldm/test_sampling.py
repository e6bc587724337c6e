"""Samplers: golden parity with diffusers' schedulers, exact answers on an oracle model, guidance,
img2img, seeded randomness."""

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
)

from ldm.sampling import (
    SAMPLER_SPECS,
    Denoiser,
    classifier_free_guidance,
    karras_sigmas,
    sample,
    sampler_sigmas,
    spaced_timesteps,
)
from ldm.schedule import make_betas, rescale_zero_terminal_snr, schedule_buffers

ALPHAS_CUMPROD = schedule_buffers(make_betas())["alphas_cumprod"]  # SD v1/v2 schedule
LOG_SIGMAS = ((1 - ALPHAS_CUMPROD.double()) / ALPHAS_CUMPROD.double()).sqrt().log()
# Stable Diffusion's scheduler_config.json, plus what each diffusers class needs to act as SD's.
SD_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
)
DIFFUSERS_SCHEDULERS = {
    "ddim": lambda **kw: DDIMScheduler(
        **SD_CONFIG, clip_sample=False, set_alpha_to_one=False, **kw
    ),
    "plms": lambda **kw: PNDMScheduler(
        **SD_CONFIG, skip_prk_steps=True, set_alpha_to_one=False, **kw
    ),
    "euler": lambda **kw: EulerDiscreteScheduler(**SD_CONFIG, **kw),
    "euler_a": lambda **kw: EulerAncestralDiscreteScheduler(**SD_CONFIG, **kw),
    "heun": lambda **kw: HeunDiscreteScheduler(**SD_CONFIG, **kw),
    "dpmpp_2m": lambda **kw: DPMSolverMultistepScheduler(**SD_CONFIG, **kw),
}
PREDICTION_TYPE = {"eps": "epsilon", "v": "v_prediction"}
# Samplers of networks whose output is shaped like x; ddpm_learned (which also reads a learned
# variance) is tested in tests/ldm/test_dit_sampling.py.
SAMPLERS = [name for name, spec in SAMPLER_SPECS.items() if not spec.learned_variance]
SHAPE = (2, 4, 8, 8)


def alphas_cumprod_at(t: torch.Tensor) -> torch.Tensor:
    """abar at (fractional) t, interpolating log sigma as the Denoiser does - exact at integers."""
    t = t.double().cpu()
    low = t.floor().long().clamp(max=998)
    log_sigma = torch.lerp(LOG_SIGMAS[low], LOG_SIGMAS[low + 1], t - low)
    return 1 / (1 + (2 * log_sigma).exp())


class GaussianDataNet:
    """Stand-in for a trained UNet: the exact eps (or v) predictor for data ~ N(mean, std^2), plus
    a small nonlinear term of (x, t, context) so that any difference in x, t or context shows.
    std = 0, perturbation = 0 is the oracle of a single data point x_0 = mean."""

    def __init__(self, parameterization="eps", std=0.5, perturbation=0.2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.mean = torch.randn(1, *SHAPE[1:], generator=g)
        self.weight = torch.randn(4, 4, 3, 3, generator=g) * 0.3
        self.parameterization, self.std, self.perturbation = parameterization, std, perturbation
        self.calls = []

    def __call__(self, x, t, cond):
        context = cond["crossattn"]
        self.calls.append((x.shape[0], t.clone()))
        abar = alphas_cumprod_at(t).to(x.dtype).view(-1, 1, 1, 1)
        a, b = abar.sqrt(), (1 - abar).sqrt()
        # E[x_0 | x_t] for Gaussian data (a Wiener filter), then the perturbation.
        x0 = self.mean + self.std**2 * a / (a**2 * self.std**2 + b**2) * (x - a * self.mean)
        features = torch.nn.functional.conv2d(x, self.weight, padding=1)
        phase = t.float().view(-1, 1, 1, 1) / 300 + context.mean(dim=(1, 2)).view(-1, 1, 1, 1)
        x0 = x0 + self.perturbation * torch.tanh(features + torch.sin(phase))
        eps = (x - a * x0) / b
        return eps if self.parameterization == "eps" else a * eps - b * x0


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), {"crossattn": torch.randn(SHAPE[0], 3, 5, generator=g)}


def run_diffusers(
    scheduler, model, noise, context, steps, generator=None, init=None, strength=1.0, **step_kwargs
):
    """The loop of diffusers' Stable Diffusion (img2img) pipeline, without guidance."""
    scheduler.set_timesteps(steps)
    timesteps, x = scheduler.timesteps, noise * scheduler.init_noise_sigma
    if init is not None:  # StableDiffusionImg2ImgPipeline.get_timesteps + prepare_latents
        start = steps - min(int(steps * strength), steps)
        timesteps = timesteps[start * scheduler.order :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start * scheduler.order)
        x = scheduler.add_noise(init, noise, timesteps[:1])
    trajectory = []
    for t in timesteps:
        out = model(scheduler.scale_model_input(x, t), t.reshape(1).expand(x.shape[0]), context)
        if generator is not None:
            step_kwargs["generator"] = generator
        x = scheduler.step(out, t, x, **step_kwargs).prev_sample
        trajectory.append(x)
    return x, trajectory


def assert_matches(ours, reference, rel=2e-5):
    scale = reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=0, atol=rel * scale)


PARITY_CASES = [
    # (sampler, parameterization, sample() kwargs, diffusers kwargs, steps)
    *[(s, p, {}, {}, 12) for s in ("ddim", "euler", "heun", "dpmpp_2m") for p in ("eps", "v")],
    ("plms", "eps", {}, {}, 12),
    ("ddim", "v", {"eta": 0.6}, {"eta": 0.6}, 10),
    ("ddim", "eps", {"timestep_spacing": "trailing"}, {"timestep_spacing": "trailing"}, 10),
    ("euler", "eps", {"timestep_spacing": "leading"}, {"timestep_spacing": "leading"}, 10),
    ("euler", "v", {"karras": True}, {"use_karras_sigmas": True}, 10),
    ("heun", "eps", {"karras": True}, {"use_karras_sigmas": True}, 8),
    ("dpmpp_2m", "eps", {"karras": True}, {"use_karras_sigmas": True}, 15),
    ("dpmpp_2m", "v", {"timestep_spacing": "leading"}, {"timestep_spacing": "leading"}, 10),
    ("euler_a", "eps", {}, {}, 10),
    ("euler_a", "v", {}, {}, 10),
]


@pytest.mark.parametrize("sampler,parameterization,ours_kwargs,theirs_kwargs,steps", PARITY_CASES)
def test_parity_with_diffusers(sampler, parameterization, ours_kwargs, theirs_kwargs, steps):
    model, (noise, context) = GaussianDataNet(parameterization), make_inputs()
    config_kwargs = {k: v for k, v in theirs_kwargs.items() if k != "eta"}
    scheduler = DIFFUSERS_SCHEDULERS[sampler](
        prediction_type=PREDICTION_TYPE[parameterization], **config_kwargs
    )
    stochastic = sampler == "euler_a" or "eta" in ours_kwargs
    step_kwargs = {"eta": theirs_kwargs["eta"]} if "eta" in theirs_kwargs else {}
    generator = torch.Generator().manual_seed(7) if stochastic else None
    reference, reference_trajectory = run_diffusers(
        scheduler, model, noise, context, steps, generator=generator, **step_kwargs
    )
    trajectory = []
    ours = sample(
        model,
        noise,
        ALPHAS_CUMPROD,
        sampler=sampler,
        steps=steps,
        cond=context,
        parameterization=parameterization,
        generator=torch.Generator().manual_seed(7) if stochastic else None,
        callback=lambda info: trajectory.append(info["x"]),
        **ours_kwargs,
    )
    assert_matches(ours, reference)
    # Samples stay in the same space as diffusers' for DDIM and the Euler family (DPM-Solver keeps
    # the VP-scaled sample, Heun and PLMS take extra scheduler steps): compare every step there.
    if sampler in ("ddim", "euler", "euler_a"):
        assert len(trajectory) == len(reference_trajectory) == steps
        for x, reference_x in zip(trajectory, reference_trajectory):
            assert_matches(x, reference_x)


# Not plms: diffusers' PNDMScheduler keeps its step counter when the pipeline skips steps, so its
# img2img evaluates the model one step off after the first step.
@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmpp_2m"])
def test_img2img_parity_with_diffusers(sampler):
    model, (noise, context) = GaussianDataNet(), make_inputs()
    init = make_inputs(seed=1)[0] * 0.5
    reference, _ = run_diffusers(
        DIFFUSERS_SCHEDULERS[sampler](), model, noise, context, 10, init=init, strength=0.65
    )
    calls_before = len(model.calls)
    ours = sample(
        model,
        noise,
        ALPHAS_CUMPROD,
        sampler=sampler,
        steps=10,
        cond=context,
        init_latent=init,
        strength=0.65,
    )
    assert len(model.calls) - calls_before == 6  # int(10 * 0.65) steps
    assert_matches(ours, reference)


@pytest.mark.parametrize(
    "sampler,spacing,steps",
    [
        (s, sp, n)
        for s in ("ddim", "euler", "dpmpp_2m")
        for sp in ("leading", "linspace", "trailing")
        for n in (7, 20, 50)
    ],
)
def test_timesteps_and_sigmas_match_diffusers(sampler, spacing, steps):
    scheduler = DIFFUSERS_SCHEDULERS[sampler](timestep_spacing=spacing)
    scheduler.set_timesteps(steps)
    ours = spaced_timesteps(
        steps, spacing, integer=sampler != "euler", final_to_zero=sampler == "dpmpp_2m"
    )
    torch.testing.assert_close(ours.float(), scheduler.timesteps.float())
    if sampler != "ddim":
        sigmas = sampler_sigmas(Denoiser(None, ALPHAS_CUMPROD), steps, sampler, spacing)
        torch.testing.assert_close(sigmas.float(), scheduler.sigmas, rtol=2e-5, atol=0)


def test_leading_spacing_is_compvis_uniform_ddim_plus_one():
    for steps in (10, 20, 25, 50, 100):
        # CompVis make_ddim_timesteps("uniform"): range(0, T, T // steps), then + 1.
        compvis = [t + 1 for t in range(0, 1000, 1000 // steps)][::-1]
        assert spaced_timesteps(steps, "leading").long().tolist() == compvis


def test_sigma_to_t_inverts_the_schedule():
    denoiser = Denoiser(None, ALPHAS_CUMPROD)
    torch.testing.assert_close(denoiser.sigma_to_t(denoiser.sigmas), torch.arange(1000.0).double())
    t = torch.tensor([0.0, 3.25, 500.7, 998.9, 999.0], dtype=torch.float64)
    abar = alphas_cumprod_at(t)
    sigma = ((1 - abar) / abar).sqrt()
    torch.testing.assert_close(denoiser.sigma_to_t(sigma), t)
    quantized = Denoiser(None, ALPHAS_CUMPROD, quantize=True)
    assert quantized.sigma_to_t(sigma).tolist() == [0, 3, 501, 999, 999]
    # Outside the schedule t clamps to the ends.
    assert denoiser.sigma_to_t(torch.tensor([1e-4, 100.0])).tolist() == [0, 999]


def test_karras_sigmas_endpoints():
    sigmas = karras_sigmas(10, 0.0292, 14.6146, rho=7.0)
    assert sigmas.shape == (11,) and sigmas[-1] == 0
    torch.testing.assert_close(
        sigmas[[0, -2]], torch.tensor([14.6146, 0.0292], dtype=torch.float64)
    )
    assert (sigmas[1:] < sigmas[:-1]).all()
    # sample() uses the schedule's own sigma_min / sigma_max: sigma(t=0) and sigma(t=999).
    denoiser = Denoiser(None, ALPHAS_CUMPROD)
    schedule = sampler_sigmas(denoiser, 10, "dpmpp_2m", karras=True)
    torch.testing.assert_close(schedule[[0, -2]], denoiser.sigmas[[-1, 0]])


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_exact_oracle_gives_the_data_point(sampler, parameterization):
    model = GaussianDataNet(parameterization, std=0.0, perturbation=0.0)
    noise, context = make_inputs()
    out = sample(
        model,
        noise,
        ALPHAS_CUMPROD,
        sampler=sampler,
        steps=8,
        cond=context,
        parameterization=parameterization,
        generator=torch.Generator().manual_seed(0),
    )
    expected = model.mean.expand(SHAPE)
    if sampler in ("ddim", "plms"):
        # Timestep-space samplers stop at t = 0's noise level. With an exact x_0 every eps
        # prediction after the first equals the first one, the noise direction of x_T.
        abar_first = ALPHAS_CUMPROD[int(spaced_timesteps(8, "leading")[0])].double()
        eps = (noise - abar_first.sqrt() * model.mean) / (1 - abar_first).sqrt()
        abar = ALPHAS_CUMPROD[0].double()
        expected = abar.sqrt() * model.mean + (1 - abar).sqrt() * eps
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=2e-5)


def test_zero_terminal_snr_schedule():
    """Lin et al. 2023: v-prediction + trailing spacing starts from pure noise at abar_T = 0."""
    alphas_cumprod = schedule_buffers(rescale_zero_terminal_snr(make_betas()))["alphas_cumprod"]
    target, (noise, context) = torch.randn(SHAPE), make_inputs()

    def v_oracle(x, t, cond):  # single data point `target`, integer t
        abar = alphas_cumprod[t].view(-1, 1, 1, 1)
        eps = (x - abar.sqrt() * target) / (1 - abar).sqrt()
        return abar.sqrt() * eps - (1 - abar).sqrt() * target

    kwargs = dict(steps=5, cond=context, timestep_spacing="trailing")
    out = sample(v_oracle, noise, alphas_cumprod, sampler="ddim", parameterization="v", **kwargs)
    abar_0 = alphas_cumprod[0]
    # From x_T = noise at abar_T = 0 the first eps prediction is exactly the noise.
    torch.testing.assert_close(out, abar_0.sqrt() * target + (1 - abar_0).sqrt() * noise)
    with pytest.raises(ValueError, match="zero SNR"):
        sample(v_oracle, noise, alphas_cumprod, sampler="ddim", parameterization="eps", **kwargs)
    with pytest.raises(ValueError, match="zero SNR"):
        sample(v_oracle, noise, alphas_cumprod, sampler="plms", parameterization="v", **kwargs)
    # Sigma-space samplers replace sigma_max = inf by a finite one (as diffusers does).
    sigmas = sampler_sigmas(Denoiser(None, alphas_cumprod), 5, "euler", "trailing")
    assert torch.isfinite(sigmas).all() and sigmas[0] > 1000


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_v_and_eps_parameterizations_agree(sampler):
    eps_model, (noise, context) = GaussianDataNet("eps"), make_inputs()
    v_model = GaussianDataNet("v")
    kwargs = dict(sampler=sampler, steps=6, cond=context, generator=None)
    outs = []
    for model, parameterization in ((eps_model, "eps"), (v_model, "v")):
        if sampler == "euler_a":
            kwargs["generator"] = torch.Generator().manual_seed(3)
        outs.append(
            sample(model, noise, ALPHAS_CUMPROD, parameterization=parameterization, **kwargs)
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler,extra", [("euler_a", {}), ("ddim", {"eta": 1.0})])
def test_randomness_comes_from_the_generator_only(sampler, extra):
    model, (noise, context) = GaussianDataNet(), make_inputs()

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return sample(
            model,
            noise,
            ALPHAS_CUMPROD,
            sampler=sampler,
            steps=5,
            cond=context,
            generator=generator,
            **extra,
        )

    global_state = torch.get_rng_state()
    first, again, other = run(1), run(1), run(2)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-2
    with pytest.raises(ValueError, match="generator"):
        sample(model, noise, ALPHAS_CUMPROD, sampler=sampler, steps=5, cond=context, **extra)


def test_classifier_free_guidance_wrapper():
    model, (noise, context) = GaussianDataNet(), make_inputs()
    # batch 1 broadcasts, like an empty prompt
    uncond = {"crossattn": torch.zeros(1, *context["crossattn"].shape[1:])}
    t = torch.tensor([500, 20])
    cond_out = model(noise, t, context)
    uncond_out = model(noise, t, {"crossattn": uncond["crossattn"].expand_as(context["crossattn"])})
    model.calls.clear()
    torch.testing.assert_close(
        classifier_free_guidance(model, uncond, 1.0)(noise, t, context), cond_out
    )
    guided = classifier_free_guidance(model, uncond, 7.5)(noise, t, context)
    torch.testing.assert_close(guided, uncond_out + 7.5 * (cond_out - uncond_out))
    assert [batch for batch, _ in model.calls] == [4, 4]  # one batched call of 2B each time


def test_guidance_in_sample():
    model, (noise, context) = GaussianDataNet(), make_inputs()
    empty, negative = {"crossattn": torch.zeros(1, 3, 5)}, {"crossattn": torch.full((2, 3, 5), 0.7)}
    kwargs = dict(sampler="euler", steps=6, cond=context)
    conditional = sample(model, noise, ALPHAS_CUMPROD, **kwargs)
    assert torch.equal(
        sample(model, noise, ALPHAS_CUMPROD, uncond=empty, scale=1.0, **kwargs), conditional
    )
    guided = sample(model, noise, ALPHAS_CUMPROD, uncond=empty, scale=5.0, **kwargs)
    with_negative = sample(model, noise, ALPHAS_CUMPROD, uncond=negative, scale=5.0, **kwargs)
    assert (guided - conditional).abs().max() > 1e-2
    assert (with_negative - guided).abs().max() > 1e-2


@pytest.mark.parametrize("sampler", ["ddim", "dpmpp_2m"])
def test_img2img_strength_bounds(sampler):
    model, (noise, context) = GaussianDataNet(), make_inputs()
    init = make_inputs(seed=1)[0]
    kwargs = dict(sampler=sampler, steps=10, cond=context)
    unchanged = sample(model, noise, ALPHAS_CUMPROD, init_latent=init, strength=0.0, **kwargs)
    assert torch.equal(unchanged, init) and not model.calls
    ignored = sample(model, noise, ALPHAS_CUMPROD, init_latent=init, strength=1.0, **kwargs)
    assert torch.equal(ignored, sample(model, noise, ALPHAS_CUMPROD, **kwargs))
    model.calls.clear()
    sample(model, noise, ALPHAS_CUMPROD, init_latent=init, strength=0.5, **kwargs)
    if sampler == "ddim":
        full_schedule = spaced_timesteps(10, "leading")
    else:
        full_schedule = spaced_timesteps(10, "linspace", final_to_zero=True)
    assert len(model.calls) == 5  # the last int(10 * 0.5) steps
    assert model.calls[0][1][0].item() == full_schedule[5].item()


def test_callback_and_bad_arguments():
    model, (noise, context) = GaussianDataNet(), make_inputs()
    seen = []
    sample(
        model, noise, ALPHAS_CUMPROD, sampler="heun", steps=4, cond=context, callback=seen.append
    )
    assert [info["i"] for info in seen] == [0, 1, 2, 3] and seen[-1]["sigma"] > 0
    assert len(model.calls) == 7  # Heun: 2 calls per step, the last step is Euler
    bad = [
        (dict(sampler="lms"), "sampler must be one of"),
        (dict(sampler="euler", eta=0.5), "eta only applies"),
        (dict(sampler="plms", karras=True), "karras"),
        (dict(scale=7.5), "needs uncond"),
        (dict(strength=0.5), "init_latent"),
        (dict(timestep_spacing="uniform"), "timestep spacing"),
        (dict(parameterization="x0"), "parameterization"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            sample(model, noise, ALPHAS_CUMPROD, cond=context, **kwargs)
