"""The learned-sigma VLB term of `LatentDiffusion.loss_at` reads x0 from the model's output by
the parameterization's own formula, checked with a stand-in model whose output is known:

    eps: x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar)       (Ho et al. 2020, eq. 4 solved for x0)
    v:   x0 = sqrt(abar) x_t - sqrt(1 - abar) v              (Salimans & Ho 2022, sec. 4)

and the KL of two Gaussians with the posterior's variance (Improved DDPM eq. 13 with v = -1,
Sigma = beta~_t): (coef1 * dx0)^2 / (2 beta~_t) nats per element, coef1 = beta_t sqrt(abar_{t-1})
/ (1 - abar_t) (Ho et al. eq. 7). All schedule values are recomputed here from the betas."""

import math

import pytest
import torch

from ldm.diffusion import LatentDiffusion
from ldm.objectives import LearnedVariance

CONFIG = {
    "backbone_config": {
        "target": "ldm.dit.DiT",
        "params": dict(
            input_size=8, patch_size=2, hidden_size=16, depth=1, num_heads=2, in_channels=3
        ),
    },
    "first_stage_config": {"target": "ldm.autoencoder.IdentityFirstStage"},
    "conditioner_config": {"target": "ldm.conditioning.ClassLabels", "params": {"num_classes": 2}},
    "schedule": {"beta_schedule": "sqrt_linear", "linear_start": 1e-4, "linear_end": 0.02},
}
T = torch.tensor([1, 30, 400, 999])  # t > 0: the KL term (t = 0 is the decoder likelihood)


def by_hand(betas: torch.Tensor, t: torch.Tensor) -> dict:
    betas = betas.double()
    abar = torch.cumprod(1 - betas, 0)
    prev = torch.cat([torch.ones(1, dtype=abar.dtype), abar[:-1]])
    return {
        "a": abar[t].sqrt(),
        "s": (1 - abar[t]).sqrt(),
        "coef1": betas[t] * prev[t].sqrt() / (1 - abar[t]),
        "var": betas[t] * (1 - prev[t]) / (1 - abar[t]),
    }


@pytest.mark.parametrize("parameterization", ["eps", "v"])
@pytest.mark.parametrize("error", [0.0, 0.1])
def test_vlb_reads_x0_by_the_parameterizations_formula(parameterization, error):
    """A stand-in model outputs the true eps / v plus `error`, and v = -1 for the variance: the
    loss is error^2 (MSE) + the KL of the x0 error that parameterization implies, by hand."""
    torch.manual_seed(0)
    model = LatentDiffusion(**CONFIG, parameterization=parameterization)
    assert isinstance(model.objective, LearnedVariance) and model.objective.weight(T, {}) is None
    g = torch.Generator().manual_seed(1)
    z, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    h = by_hand(model.betas, T)
    a, s = (h[k].float().view(-1, 1, 1, 1) for k in ("a", "s"))
    truth = noise if parameterization == "eps" else a * noise - s * z

    def stand_in(x_t, t, cond):
        assert torch.equal(t, T)
        return torch.cat([truth + error, -torch.ones_like(truth)], dim=1)

    model.apply_model = stand_in
    loss = model.loss_at(z, {}, T, noise, {}).double()
    # The x0 error an output error makes: eps -> -s/a * error, v -> -s * error.
    dx0 = -h["s"] * error / (h["a"] if parameterization == "eps" else 1.0)
    kl_bits = (h["coef1"] * dx0) ** 2 / (2 * h["var"]) / math.log(2)
    torch.testing.assert_close(loss, error**2 + kl_bits, rtol=1e-4, atol=1e-6)
