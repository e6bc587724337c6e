"""ldm.vlb: the Improved-DDPM variational bound that trains DiT's learned variances."""

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from ldm import vlb
from ldm.diffusion import LatentDiffusion
from ldm.objectives import LearnedVariance
from ldm.schedule import make_betas

BETAS = make_betas("sqrt_linear", 1000, 0.0001, 0.02)  # DiT's schedule: linspace(1e-4, 0.02)


def test_posterior_variance_at_zero_is_taken_from_step_one():
    q = vlb.posterior(BETAS)
    assert q["log_variance"][0] == q["log_variance"][1]
    abar = torch.cumprod(1 - BETAS, 0)
    expected = BETAS[5] * (1 - abar[4]) / (1 - abar[5])
    torch.testing.assert_close(q["log_variance"][5], expected.log())


def test_learned_range_interpolates_between_the_two_variances():
    """v = 1 -> beta_t, v = -1 -> the posterior's beta~_t, v = 0 -> their geometric mean."""
    q, t = vlb.posterior(BETAS), torch.tensor([10, 500])
    v = torch.tensor([1.0, -1.0]).view(2, 1, 1, 1)
    got = vlb.learned_range_log_variance(q, v, t).flatten()
    torch.testing.assert_close(got[0], BETAS[10].log().float())
    torch.testing.assert_close(got[1], q["log_variance"][500].float())
    middle = vlb.learned_range_log_variance(q, torch.zeros(1, 1, 1, 1), t[:1]).flatten()
    torch.testing.assert_close(middle[0], (0.5 * (BETAS[10].log() + q["log_variance"][10])).float())


def test_normal_kl_matches_torch_distributions():
    m1, m2, lv1, lv2 = torch.randn(4, 10).double().unbind(0)
    expected = kl_divergence(Normal(m1, (0.5 * lv1).exp()), Normal(m2, (0.5 * lv2).exp()))
    torch.testing.assert_close(vlb.normal_kl(m1, lv1, m2, lv2), expected)


def test_decoder_likelihood_is_the_mass_of_the_pixel_bin():
    """Inner bins: Phi((x + 1/255 - mu)/s) - Phi((x - 1/255 - mu)/s); edge bins reach infinity."""
    x = torch.tensor([-1.0, -0.2, 0.5, 1.0])
    mu, log_s = torch.tensor([-0.9, -0.21, 0.4, 0.9]), torch.full((4,), math.log(0.05))
    normal = Normal(mu, log_s.exp())
    expected = torch.stack(
        [
            normal.cdf(x[0] + 1 / 255)[0],
            (normal.cdf(x + 1 / 255) - normal.cdf(x - 1 / 255))[1],
            (normal.cdf(x + 1 / 255) - normal.cdf(x - 1 / 255))[2],
            1 - normal.cdf(x[3] - 1 / 255)[3],
        ]
    ).log()
    got = vlb.discretized_gaussian_log_likelihood(x, mu, log_s)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)  # tanh approximation of Phi


def test_vlb_is_zero_for_the_true_posterior_and_grows_with_the_error():
    """For t > 0 the term is KL(q || p): zero when the model's x_0 and variance are q's own."""
    g = torch.Generator().manual_seed(0)
    x_0, x_t = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    t, v_posterior = torch.tensor([3, 40]), -torch.ones(2, 4, 4, 4)  # beta ~ beta~ later
    exact = vlb.vlb_bits_per_dim(BETAS, x_0, x_t, t, x_0, v_posterior)
    torch.testing.assert_close(exact, torch.zeros(2), atol=1e-6, rtol=0)
    off = vlb.vlb_bits_per_dim(BETAS, x_0, x_t, t, x_0 + 0.1, v_posterior)
    wide = vlb.vlb_bits_per_dim(BETAS, x_0, x_t, t, x_0, torch.ones(2, 4, 4, 4))
    assert (off > 0).all() and (wide > 0).all()
    # The mean error term by hand: (coef1 * 0.1)^2 / (2 var) nats per element, in bits.
    q = vlb.posterior(BETAS)
    by_hand = (q["mean_coef1"][t] * 0.1) ** 2 / (2 * q["log_variance"][t].exp()) / math.log(2)
    torch.testing.assert_close(off, by_hand.float(), rtol=1e-4, atol=1e-7)


def test_vlb_at_step_zero_is_the_decoder_likelihood():
    x_0 = torch.tensor([-1.0, 0.0, 0.5, 1.0]).view(1, 1, 2, 2)
    x_t, t, v = x_0 + 0.01, torch.tensor([0]), torch.zeros(1, 1, 2, 2)
    got = vlb.vlb_bits_per_dim(BETAS, x_0, x_t, t, x_0, v)
    q = vlb.posterior(BETAS)
    mean = vlb.posterior_mean(q, x_0, x_t, t)
    log_variance = vlb.learned_range_log_variance(q, v, t)
    nll = -vlb.discretized_gaussian_log_likelihood(x_0, mean, 0.5 * log_variance)
    torch.testing.assert_close(got, nll.mean().view(1) / math.log(2))


TINY_DIT = {
    "backbone_config": {
        "target": "ldm.dit.DiT",
        "params": dict(input_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2),
    },
    "first_stage_config": {"target": "ldm.autoencoder.IdentityFirstStage"},
    "conditioner_config": {"target": "ldm.conditioning.ClassLabels", "params": {"num_classes": 3}},
    "schedule": {"beta_schedule": "sqrt_linear", "linear_start": 1e-4, "linear_end": 0.02},
}


def tiny_dit_model(parameterization: str = "eps", **params) -> LatentDiffusion:
    config = {**TINY_DIT, "backbone_config": {**TINY_DIT["backbone_config"]}}
    config["parameterization"] = parameterization
    config["backbone_config"]["params"] = {**TINY_DIT["backbone_config"]["params"], **params}
    config["backbone_config"]["params"]["in_channels"] = 3  # identity first stage: RGB
    torch.manual_seed(0)
    model = LatentDiffusion(**config)
    with torch.no_grad():  # non-zero output layers: DiT's init predicts exactly 0
        for p in model.backbone.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_learned_sigma_loss_is_mse_plus_vlb_with_the_mean_frozen(monkeypatch, parameterization):
    """The eps/v half gets exactly the gradient of the plain MSE (the VLB's mean is detached);
    the variance half gets gradient from the VLB alone."""
    model = tiny_dit_model(parameterization)
    batch = {"image": torch.rand(4, 3, 8, 8) * 2 - 1, "label": torch.tensor([0, 1, 2, 1])}
    linear = model.backbone.final_layer.linear

    def loss_and_grad():
        model.zero_grad()
        loss, _, _ = model.diffusion_loss(batch, torch.Generator().manual_seed(3))
        loss.backward()
        return loss.detach(), linear.weight.grad.view(2, 2, 6, -1).clone()  # (p, p, C_out, D)

    hybrid, grad = loss_and_grad()
    monkeypatch.setattr(vlb, "vlb_bits_per_dim", lambda *args: torch.zeros(4))
    mse, grad_mse = loss_and_grad()
    assert hybrid > mse
    torch.testing.assert_close(grad[:, :, :3], grad_mse[:, :, :3])  # eps rows: MSE only
    assert grad[:, :, 3:].abs().sum() > 0 and grad_mse[:, :, 3:].abs().sum() == 0


def test_learned_sigma_model_samples_with_the_eps_half():
    model = tiny_dit_model().eval()
    assert isinstance(model.objective, LearnedVariance)
    images = model.sample([0, 2], steps=2, scale=3.0, generator=torch.Generator().manual_seed(0))
    assert images.shape == (2, 3, 8, 8) and torch.isfinite(images).all()
    # guidance against the null class: another image than the conditional model's alone
    plain = model.sample([0, 2], steps=2, scale=1.0, generator=torch.Generator().manual_seed(0))
    assert (images - plain).abs().max() > 1e-3
    out = model.predict(torch.randn(1, 3, 8, 8), torch.tensor([5]), {"y": torch.tensor([1])})
    assert out.shape == (1, 3, 8, 8)
