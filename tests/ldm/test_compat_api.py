"""The original LatentDiffusion / UNetModel Python API (issue 29 item 4), checked against the
original definitions: CompVis `ddpm.py` (q_sample, get_first_stage_encoding, apply_model's
`c_crossattn` list joined along the tokens), Ho et al. 2020 eq. 4, the SD "linear" schedule, and
k-diffusion's `CompVisDenoiser` / `sample_euler` formulas (crowsonkb/k-diffusion
`k_diffusion/external.py`, `sampling.py`: sigma = sqrt((1 - abar) / abar), c_in = 1/sqrt(sigma^2
+ 1), c_out = -sigma, t from sigma by interpolating log-sigma, Karras et al. 2022 Algorithm 2).
The weights are random and non-zero everywhere (the UNet's zero-initialised output layer too), so
a dropped context or a wrong timestep changes the numbers.
"""

import pytest
import torch

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


@pytest.fixture(scope="module")
def model(tiny_config):
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([tiny_config], []))["model"])
    with torch.no_grad():
        for p in model.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def context_of(model, prompts):
    return model.conditioning({"caption": prompts})["crossattn"]


def test_schedule_and_q_sample_are_the_originals(model):
    # SD's "linear" schedule and Ho et al. eq. 4, computed here in float64.
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)
    torch.testing.assert_close(model.alphas_cumprod.double(), abar, rtol=1e-6, atol=0)
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([0, 999])
    expected = (
        abar[t].sqrt().view(-1, 1, 1, 1) * x0 + (1 - abar[t]).sqrt().view(-1, 1, 1, 1) * noise
    )
    torch.testing.assert_close(model.q_sample(x0, t, noise), expected.float())


def test_get_learned_conditioning_is_the_text_encoders_output(model):
    prompts = ["a red circle", "a blue square"]
    c = model.get_learned_conditioning(prompts)
    assert isinstance(c, torch.Tensor) and c.shape[0] == 2
    # The original: cond_stage_model(prompts) (FrozenCLIPEmbedder.forward), a (B, T, D) tensor.
    torch.testing.assert_close(c, model.cond_stage_model(prompts))
    assert not torch.allclose(c[0], c[1])


def test_apply_model_and_unet_take_a_bare_context_tensor(model):
    torch.manual_seed(1)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 700])
    c = context_of(model, ["a red circle", "a blue square"])
    unet = model.model.diffusion_model
    with torch.no_grad():
        ours = unet(x, t, {"crossattn": c})
        other = unet(x, t, {"crossattn": torch.zeros_like(c)})
        assert not torch.allclose(ours, other, atol=1e-4)  # the context matters
        torch.testing.assert_close(model.apply_model(x, t, c), ours)
        torch.testing.assert_close(model.apply_model(x, t, cond=c), ours)
        torch.testing.assert_close(unet(x, t, c), ours)  # forward(x, timesteps, context)
        torch.testing.assert_close(unet(x, timesteps=t, context=c), ours)
        # CompVis' DiffusionWrapper form: c_crossattn is a list joined along the tokens.
        half = c.shape[1] // 2
        torch.testing.assert_close(
            model.apply_model(x, t, {"c_crossattn": [c[:, :half], c[:, half:]]}), ours
        )


def test_first_stage_round_trip_is_the_originals(model):
    torch.manual_seed(2)
    images = torch.rand(1, 3, 32, 32) * 2 - 1
    posterior = model.first_stage_model.encode(images)
    torch.manual_seed(3)
    noise = torch.randn_like(posterior.mean)
    # The original: scale_factor * (mean + std * N(0, 1)) from the posterior's moments.
    expected = 0.18215 * (posterior.mean + posterior.std * noise)
    torch.manual_seed(3)
    z = model.get_first_stage_encoding(model.encode_first_stage(images))
    torch.testing.assert_close(z, expected)
    torch.manual_seed(3)
    torch.testing.assert_close(model.get_first_stage_encoding(posterior), expected)
    decoded = model.first_stage_model.decode(z / 0.18215)
    torch.testing.assert_close(model.decode_first_stage(z), decoded)


class CompVisDenoiser(torch.nn.Module):
    """k-diffusion's `CompVisDenoiser` (DiscreteEpsDDPMDenoiser, quantize=False), transcribed:
    it reads only `model.alphas_cumprod` and `model.apply_model(x, t, cond=...)`."""

    def __init__(self, model):
        super().__init__()
        self.inner_model = model
        self.sigmas = ((1 - model.alphas_cumprod) / model.alphas_cumprod) ** 0.5
        self.log_sigmas = self.sigmas.log()

    def sigma_to_t(self, sigma):
        log_sigma = sigma.log()
        dists = log_sigma - self.log_sigmas[:, None]
        low_idx = dists.ge(0).cumsum(dim=0).argmax(dim=0).clamp(max=self.log_sigmas.shape[0] - 2)
        high_idx = low_idx + 1
        low, high = self.log_sigmas[low_idx], self.log_sigmas[high_idx]
        w = ((low - log_sigma) / (low - high)).clamp(0, 1)
        return ((1 - w) * low_idx + w * high_idx).view(sigma.shape)

    def forward(self, input, sigma, **kwargs):
        c_out = (-sigma)[:, None, None, None]
        c_in = (1 / (sigma**2 + 1) ** 0.5)[:, None, None, None]
        eps = self.inner_model.apply_model(input * c_in, self.sigma_to_t(sigma), **kwargs)
        return input + eps * c_out


def sample_euler(model, x, sigmas, extra_args):
    """k-diffusion's sample_euler without churn (Karras et al. 2022, Algorithm 2)."""
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def test_k_diffusion_compvis_denoiser_samples_our_model_as_the_original(model):
    denoiser = CompVisDenoiser(model)
    c = model.get_learned_conditioning(["a red circle", "a blue square"])
    torch.manual_seed(4)
    x = torch.randn(2, 4, 8, 8)
    unet = model.model.diffusion_model
    with torch.no_grad():
        # On the schedule's own levels t is the level's index, and the denoised value is the
        # DDPM x0 estimate (x_t - sqrt(1 - abar) eps) / sqrt(abar) at x_t = x / sqrt(sigma^2 + 1).
        for k in (50, 600):
            sigma = denoiser.sigmas[k].expand(2)
            assert torch.allclose(denoiser.sigma_to_t(sigma), torch.tensor(float(k)), atol=1e-3)
            abar = model.alphas_cumprod[k]
            x_t = x / (sigma[0] ** 2 + 1) ** 0.5
            eps = unet(x_t, torch.full((2,), k), {"crossattn": c})
            x0 = (x_t - (1 - abar).sqrt() * eps) / abar.sqrt()
            torch.testing.assert_close(denoiser(x, sigma, cond=c), x0, rtol=1e-4, atol=1e-4)
        # Between two levels t is fractional and the UNet takes it as it is.
        between = (denoiser.sigmas[300] * denoiser.sigmas[301]).sqrt().expand(2)
        t = denoiser.sigma_to_t(between)
        assert torch.allclose(t, torch.tensor(300.5), atol=1e-3)

        # A few Euler steps from sigma_max: k-diffusion's loop on our model equals the same loop
        # on the UNet called directly with our named conditioning.
        sigmas = torch.cat([denoiser.sigmas[[999, 700, 400, 100, 10]], torch.zeros(1)])
        start = torch.randn(2, 4, 8, 8) * sigmas[0]
        sample = sample_euler(denoiser, start, sigmas, {"cond": c})

        def direct(x, sigma):
            k = denoiser.sigma_to_t(sigma)
            c_in = (1 / (sigma**2 + 1) ** 0.5)[:, None, None, None]
            eps = unet(x * c_in, k, {"crossattn": c})
            return x - sigma[:, None, None, None] * eps

        torch.testing.assert_close(sample, sample_euler(direct, start, sigmas, {}))
        assert torch.isfinite(sample).all() and not torch.allclose(sample, start)
