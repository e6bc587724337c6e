"""FID and KID from feature arrays (N, D), computed in float64.

- FID (Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule Converge to a Local
  Nash Equilibrium", arXiv:1706.08500): the Frechet distance between Gaussians fitted to the
  two feature sets, ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)). Biased for small N (it
  falls as N grows), so FIDs are comparable only at the same sample count: we report it.
- KID (Binkowski et al. 2018, "Demystifying MMD GANs", arXiv:1801.01401): the unbiased estimate
  of the squared MMD with the cubic polynomial kernel k(x, y) = (x.y / D + 1)^3, averaged over
  random subsets; unbiased at any N, with a standard deviation over the subsets.

Both match `torchmetrics`' FrechetInceptionDistance / KernelInceptionDistance given the same
features (tests/lun/eval/test_fid.py).
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Gaussian:
    """Mean (D,) and covariance (D, D) of a feature set, float64, and its sample count."""

    mu: np.ndarray
    sigma: np.ndarray
    count: int


def fit_gaussian(features) -> Gaussian:
    """Mean and unbiased covariance (N - 1, as numpy's `np.cov`) of (N, D) features, in float64.

    Two passes (mean, then centred products), which keeps the digits a one-pass sum of x x^T
    loses when the mean is large against the spread."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"FID needs at least 2 feature vectors (N, D), got shape {x.shape}")
    mu = x.mean(axis=0)
    centred = x - mu
    return Gaussian(mu, centred.T @ centred / (x.shape[0] - 1), x.shape[0])


def trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """Tr((S1 S2)^(1/2)) for symmetric positive semi-definite S1, S2.

    S1 S2 is similar to the symmetric S1^(1/2) S2 S1^(1/2) (same eigenvalues, all >= 0), whose
    eigenvalues `eigvalsh` finds stably; no scipy `sqrtm` and no complex parts to drop. Round-off
    can make tiny eigenvalues negative: they are clipped to 0.
    """
    w, v = np.linalg.eigh(sigma1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T  # S1^(1/2)
    middle = root1 @ sigma2 @ root1
    eigenvalues = np.linalg.eigvalsh((middle + middle.T) / 2)
    return float(np.sqrt(np.clip(eigenvalues, 0, None)).sum())


def frechet_distance(a: Gaussian, b: Gaussian) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a) + Tr(S_b) - 2 Tr((S_a S_b)^(1/2)) (Heusel et al. 2017, eq. 6)."""
    if a.mu.shape != b.mu.shape:
        raise ValueError(f"FID: feature sizes differ ({a.mu.shape[0]} vs {b.mu.shape[0]})")
    mean_term = float(((a.mu - b.mu) ** 2).sum())
    trace_term = float(np.trace(a.sigma) + np.trace(b.sigma))
    return mean_term + trace_term - 2.0 * trace_sqrt_product(a.sigma, b.sigma)


def fid(real, fake) -> float:
    """FID between two feature arrays (N, D)."""
    return frechet_distance(fit_gaussian(real), fit_gaussian(fake))


def polynomial_mmd(x: torch.Tensor, y: torch.Tensor, degree: int = 3, coef: float = 1.0):
    """Unbiased MMD^2 of two equal-size sets (m, D) under k(a, b) = (a.b / D + coef)^degree:
    the within-set sums leave out the diagonal, k(x_i, x_i) (Binkowski et al. 2018, eq. 2; the
    cross term over all m^2 pairs, as their code and torch-fidelity / torchmetrics do)."""
    m, dim = x.shape
    k_xx = (x @ x.T / dim + coef) ** degree
    k_yy = (y @ y.T / dim + coef) ** degree
    k_xy = (x @ y.T / dim + coef) ** degree
    within = (k_xx.sum() - k_xx.diagonal().sum() + k_yy.sum() - k_yy.diagonal().sum()) / (
        m * (m - 1)
    )
    return within - 2 * k_xy.sum() / (m * m)


def kid(
    real, fake, subsets: int = 100, subset_size: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """KID: mean and standard deviation (over `subsets`) of the polynomial-kernel MMD^2 between
    random subsets of `subset_size` real and fake features (fewer when a set is smaller).

    Each subset draws a permutation of the real set, then of the fake set, from a generator
    seeded with `seed` - the order torchmetrics draws in from the global generator."""
    x = torch.as_tensor(np.asarray(real), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(fake), dtype=torch.float64)
    size = min(subset_size, x.shape[0], y.shape[0])
    if size < 2:
        raise ValueError(f"KID needs at least 2 feature vectors per set, got {size}")
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(subsets):
        real_subset = x[torch.randperm(x.shape[0], generator=generator)[:size]]
        fake_subset = y[torch.randperm(y.shape[0], generator=generator)[:size]]
        values.append(polynomial_mmd(real_subset, fake_subset))
    values = torch.stack(values)
    return float(values.mean()), float(values.std(unbiased=False))


def fid_kid(
    reference, features, kid_subsets: int = 100, kid_subset_size: int = 1000, seed: int = 0
) -> dict[str, float]:
    """{"fid", "kid", "kid_std", "num_images"} of generated `features` against `reference`: what
    the evaluation callback logs and scripts/evaluate.py reports."""
    kid_mean, kid_std = kid(reference, features, kid_subsets, kid_subset_size, seed)
    return {
        "fid": fid(reference, features),
        "kid": kid_mean,
        "kid_std": kid_std,
        "num_images": float(len(features)),
    }
