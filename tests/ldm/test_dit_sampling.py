"""ddpm_learned: ancestral DDPM with the variances a learn_sigma model predicts (DiT's sampler),
against diffusers' DDPMScheduler(variance_type="learned_range") as the independent reference."""

import pytest
import torch
from diffusers import DDPMScheduler

from ldm.sampling import classifier_free_guidance, sample
from ldm.schedule import make_betas, schedule_buffers

BETAS = make_betas("sqrt_linear", 1000, 0.0001, 0.02)  # DiT's schedule: linspace(1e-4, 0.02)
ALPHAS_CUMPROD = schedule_buffers(BETAS)["alphas_cumprod"]
SHAPE = (2, 3, 8, 8)


class LearnedVarianceNet:
    """A fixed random network (B, C, H, W) -> (B, 2C, H, W): a prediction and v in (-1, 1) that
    both depend on x, t and the class, so every term of the step is exercised."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.mix = torch.randn(2 * SHAPE[1], SHAPE[1], generator=g) * 0.5
        self.by_class = torch.randn(5, 2 * SHAPE[1], 1, 1, generator=g)
        self.calls = []

    def __call__(self, x, t, cond):
        self.calls.append(t.clone())
        out = torch.einsum("oc,bchw->bohw", self.mix, x) + self.by_class[cond["y"]]
        out = out * (1 + t.float().view(-1, 1, 1, 1) / 1000)
        prediction, v = out.chunk(2, dim=1)
        return torch.cat([prediction, torch.tanh(v)], dim=1)


def diffusers_ddpm(net, noise, cond, steps, parameterization, seed):
    """The same sampling by diffusers' own DDPMScheduler loop."""
    scheduler = DDPMScheduler(
        trained_betas=BETAS.numpy(),
        variance_type="learned_range",
        clip_sample=False,
        timestep_spacing="linspace",
        prediction_type={"eps": "epsilon", "v": "v_prediction"}[parameterization],
    )
    # The same abar in float64, as ours: the test is about the algorithm, not float32 rounding
    # (which 1 / sqrt(abar_999) = 158 amplifies in x_0 from eps).
    scheduler.alphas_cumprod = ALPHAS_CUMPROD.double()
    scheduler.set_timesteps(steps)
    generator, x = torch.Generator().manual_seed(seed), noise
    for t in scheduler.timesteps:
        out = net(x, torch.full((x.shape[0],), int(t)), cond)
        x = scheduler.step(out, t, x, generator=generator).prev_sample.float()
    return x, scheduler.timesteps


@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_matches_diffusers_learned_range_ddpm(parameterization):
    net, cond = LearnedVarianceNet(), {"y": torch.tensor([1, 3])}
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    kwargs = dict(cond=cond, parameterization=parameterization, sampler="ddpm_learned")
    ours = sample(
        net, noise, ALPHAS_CUMPROD, steps=10, generator=torch.Generator().manual_seed(2), **kwargs
    )
    our_calls = torch.stack(net.calls)[:, 0]
    net.calls.clear()
    expected, timesteps = diffusers_ddpm(net, noise, cond, 10, parameterization, seed=2)
    # DiT's respacing visits the same steps: 999, 888, ..., 0 (both ends).
    assert our_calls.tolist() == timesteps.tolist() and timesteps[-1] == 0
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # The learned variance matters: without it (v = -1, the posterior's beta~) the result differs.
    fixed = sample(
        lambda x, t, c: torch.cat([net(x, t, c)[:, :3], -torch.ones_like(x)], 1),
        noise,
        ALPHAS_CUMPROD,
        steps=10,
        generator=torch.Generator().manual_seed(2),
        **kwargs,
    )
    assert (fixed - ours).abs().max() > 1e-2


def test_guidance_guides_the_prediction_and_keeps_the_conditional_variance():
    """DiT's forward_with_cfg: eps = uncond + s (cond - uncond); the variance half is not guided."""
    net, x = LearnedVarianceNet(), torch.randn(SHAPE)
    t, cond, uncond = (
        torch.tensor([500, 500]),
        {"y": torch.tensor([1, 2])},
        {"y": torch.tensor([4])},
    )
    guided = classifier_free_guidance(net, uncond, 4.0, channels=3)(x, t, cond)
    out_cond, out_uncond = net(x, t, cond), net(x, t, {"y": torch.tensor([4, 4])})
    torch.testing.assert_close(
        guided[:, :3], out_uncond[:, :3] + 4 * (out_cond - out_uncond)[:, :3]
    )
    torch.testing.assert_close(guided[:, 3:], out_cond[:, 3:])


def test_latent_diffusion_samples_a_learn_sigma_dit_and_refuses_a_fixed_variance_one():
    from ldm.diffusion import LatentDiffusion

    def model(learn_sigma):
        dit = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=2)
        labels = {"target": "ldm.conditioning.ClassLabels", "params": {"num_classes": 4}}
        return LatentDiffusion(
            backbone_config={
                "target": "ldm.dit.DiT",
                "params": {**dit, "num_classes": 4, "learn_sigma": learn_sigma},
            },
            first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
            conditioner_config=labels,
        )

    kwargs = dict(sampler="ddpm_learned", steps=4, scale=3.0, height=8, width=8)
    learned = model(True)
    with torch.no_grad():  # no adaLN-Zero zeros: the output depends on the input
        for p in learned.backbone.parameters():
            p.normal_(std=0.05)
    images = learned.sample([0, 2], generator=torch.Generator().manual_seed(0), **kwargs)
    assert images.shape == (2, 3, 8, 8) and torch.isfinite(images).all()
    with pytest.raises(ValueError, match="learn_sigma"):
        model(False).sample([0], generator=torch.Generator().manual_seed(0), **kwargs)
