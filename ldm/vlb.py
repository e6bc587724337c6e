"""Learned variances: the variational bound term of Improved DDPM, as DiT trains it.

Nichol & Dhariwal 2021 ("Improved Denoising Diffusion Probabilistic Models", arXiv:2102.09672)
let the network output, beside eps, a value v per pixel that interpolates the reverse-process
variance in log space between beta_t and the posterior's beta~_t (eq. 15):

    log Sigma = frac * log beta_t + (1 - frac) * log beta~_t,   frac = (v + 1) / 2.

v is trained by L_vlb (eq. 16) with the mean frozen (stop-gradient on eps, sec. 3.1: "L_hybrid =
L_simple + lambda L_vlb", DiT uses lambda = 1): a KL between Gaussians for t > 0, the discretized
Gaussian decoder likelihood at t = 0, in bits per dimension. All schedule maths is done here in
float64 from the betas, with the guided-diffusion conventions (the posterior log-variance at t = 0
is taken from t = 1, not clipped at 1e-20 as CompVis' buffer is).
"""

import math

import torch


def _at(values: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """values[t] as (B, 1, 1, 1) in like's dtype, to broadcast against images."""
    return values.to(like.device)[t].to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def posterior(betas: torch.Tensor) -> dict[str, torch.Tensor]:
    """q(x_{t-1} | x_t, x_0) of a schedule (Ho et al. 2020 eqs. 6-7), float64, per step."""
    betas = betas.to(torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
    variance = betas * (1 - prev) / (1 - alphas_cumprod)
    return {
        "alphas_cumprod": alphas_cumprod,
        "mean_coef1": betas * prev.sqrt() / (1 - alphas_cumprod),  # times x_0
        "mean_coef2": (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod),  # times x_t
        # The variance is 0 at t = 0: guided-diffusion uses the value of t = 1 there.
        "log_variance": torch.cat([variance[1:2], variance[1:]]).log(),
        "log_betas": betas.log(),
    }


def learned_range_log_variance(q: dict, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """log Sigma_theta(x_t, t) from the network's v in [-1, 1] (Improved DDPM eq. 15)."""
    frac = (v + 1) / 2
    return frac * _at(q["log_betas"], t, v) + (1 - frac) * _at(q["log_variance"], t, v)


def posterior_mean(q: dict, x_0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _at(q["mean_coef1"], t, x_t) * x_0 + _at(q["mean_coef2"], t, x_t) * x_t


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + torch.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def _standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Phi(x), with the tanh approximation guided-diffusion uses."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x, means, log_scales) -> torch.Tensor:
    """log p(x) of data in [-1, 1] in 256 bins under N(means, e^(2 log_scales)) (Ho et al. 2020
    sec. 3.3; the edge bins extend to +-infinity), elementwise, in nats."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = _standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = cdf_plus.clamp(min=1e-12).log()
    log_one_minus_cdf_min = (1.0 - cdf_min).clamp(min=1e-12).log()
    log_cdf_delta = (cdf_plus - cdf_min).clamp(min=1e-12).log()
    return torch.where(
        x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta)
    )


def vlb_bits_per_dim(
    betas: torch.Tensor,
    x_0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    pred_x0: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """L_vlb per sample (B,), in bits per dimension: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)) for
    t > 0, -log p(x_0|x_1) for t = 0. pred_x0 should be detached: only v learns from it."""
    x_0, x_t, pred_x0, v = x_0.float(), x_t.float(), pred_x0.float(), v.float()
    q = posterior(betas)
    true_mean = posterior_mean(q, x_0, x_t, t)
    true_log_variance = _at(q["log_variance"], t, x_t)
    model_mean = posterior_mean(q, pred_x0, x_t, t)
    model_log_variance = learned_range_log_variance(q, v, t)
    kl = normal_kl(true_mean, true_log_variance, model_mean, model_log_variance)
    decoder_nll = -discretized_gaussian_log_likelihood(x_0, model_mean, 0.5 * model_log_variance)
    at_zero = (t == 0).view(-1, *([1] * (x_t.dim() - 1)))
    per_element = torch.where(at_zero, decoder_nll, kl)
    return per_element.mean(dim=tuple(range(1, x_0.dim()))) / math.log(2.0)
