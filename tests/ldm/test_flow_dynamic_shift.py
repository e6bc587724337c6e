"""Flux's image-size-dependent shift per batch (`schedule.use_dynamic_shifting`): BFL's values,
diffusers' FluxPipeline steps, and training draws that follow each batch's latent size."""

import inspect
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from ldm import flow, objectives
from tests.ldm.test_flow_training import fixed_batch, tiny_flow_model

DYNAMIC = flow.FlowSchedule(timestep_sampling="uniform", use_dynamic_shifting=True)
# FLUX.1-dev's scheduler/scheduler_config.json (diffusers' FluxPipeline reads these names)
FLUX_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)


@pytest.mark.parametrize(
    "latent,mu",
    [
        ((32, 32), 0.5),  # 256 px: 16 x 16 = 256 tokens, the line's first point
        ((64, 64), 0.5 + 0.65 * 768 / 3840),  # 512 px: 1024 tokens, by hand: 0.63
        ((128, 128), 1.15),  # 1024 px: 4096 tokens, the line's second point
        ((96, 64), 0.5 + 0.65 * (48 * 32 - 256) / 3840),  # 768 x 512 px: 1536 tokens
    ],
)
def test_shift_is_bfl_exp_mu_of_the_token_count(latent, mu):
    """BFL get_lin_function(x1=256, y1=0.5, x2=4096, y2=1.15), shift exp(mu), values by hand."""
    assert DYNAMIC.shift_for(latent) == pytest.approx(math.exp(mu), rel=1e-12)
    assert flow.FlowSchedule(shift=2.0).shift_for(latent) == 2.0  # the fixed shift stays


@pytest.mark.parametrize("latent,steps", [((128, 128), 28), ((64, 64), 4), ((96, 64), 10)])
def test_sampling_steps_equal_diffusers_flux_pipeline(latent, steps):
    """FluxPipeline.__call__: mu = calculate_shift(packed length, ...), sigmas = np.linspace(1,
    1/steps, steps), retrieve_timesteps(scheduler, sigmas=sigmas, mu=mu); the scheduler shifts
    them by exp(mu) and appends 0. Ours for the same latent size must be those times."""
    source = inspect.getsource(FluxPipeline.__call__)
    assert "np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)" in source
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    tokens = (latent[0] // 2) * (latent[1] // 2)  # FluxPipeline: latents.shape[1] once packed
    mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
    retrieve_timesteps(scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = flow.FlowSchedule(use_dynamic_shifting=True).sigmas(steps, latent)
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)


def test_objective_samples_with_the_noise_size_shift():
    """RectifiedFlow.sample: the velocity network is called at the shifted times of the latent's
    own size (Euler: x <- x + (t' - t) v with v = 1, so x_0 = x_1 - 1 for any times, and each
    call's time is recorded)."""
    objective = objectives.build(
        "flow", {"schedule": {"use_dynamic_shifting": True, "timestep_sampling": "uniform"}}
    )
    for latent in ((32, 32), (128, 128)):
        seen = []

        def network(x, t, cond, seen=seen):
            seen.append(float(t[0]) / 1000)
            return torch.ones_like(x)

        noise = torch.zeros(1, 16, *latent)
        objective.sample(network, noise, {}, steps=4, cond={})
        s = DYNAMIC.shift_for(latent)
        expected = [s * u / (1 + (s - 1) * u) for u in (1.0, 0.75, 0.5, 0.25)]  # BFL grid, shifted
        assert seen == pytest.approx(expected, rel=1e-6)


def test_training_draws_the_shift_of_each_batch_latent_size():
    """LatentDiffusion.diffusion_loss with use_dynamic_shifting draws, batch by batch, the times
    the fixed shift exp(mu(tokens of that batch)) draws with the same random numbers."""
    model = tiny_flow_model()  # configs/tiny flow: its objective's schedule is swapped below

    def drawn_times(batch, **schedule):
        model.objective.times = flow.FlowSchedule(**schedule)
        with torch.no_grad():
            return model.diffusion_loss(batch, torch.Generator().manual_seed(3))[2]

    for side in (8, 16):  # 16 and 64 tokens
        batch = fixed_batch()
        batch["latent"] = torch.nn.functional.interpolate(batch["latent"], size=(side, side))
        fixed_shift = math.exp(0.5 + 0.65 * ((side // 2) ** 2 - 256) / 3840)  # BFL's line
        dynamic = drawn_times(batch, use_dynamic_shifting=True)
        torch.testing.assert_close(dynamic, drawn_times(batch, shift=fixed_shift))
        assert not torch.allclose(dynamic, drawn_times(batch, shift=1.0))


def test_dynamic_shift_needs_the_latent_size():
    with pytest.raises(ValueError, match="latent size"):
        DYNAMIC.sample_t(4)
