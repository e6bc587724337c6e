"""DDPM noise schedules: betas, the 12 schedule buffers of the original checkpoints, SNR.

Notation (Ho et al. 2020, arXiv:2006.11239): x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, with
abar_t = prod_{s<=t} (1 - beta_s). Everything is computed in float64 and only the buffers handed to
a module are cast to float32, exactly as CompVis `ddpm.register_schedule` does with numpy.
"""

import math

import torch

# Names and order of the schedule buffers stored at the root of every original SD checkpoint.
SCHEDULE_BUFFER_NAMES = (
    "betas",
    "alphas_cumprod",
    "alphas_cumprod_prev",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
)

BETA_SCHEDULES = ("linear", "scaled_linear", "cosine", "squaredcos_cap_v2", "sqrt_linear", "sqrt")


def make_betas(
    schedule: str = "linear",
    timesteps: int = 1000,
    linear_start: float = 0.00085,
    linear_end: float = 0.012,
    cosine_s: float = 8e-3,
) -> torch.Tensor:
    """Beta schedule as CompVis `make_beta_schedule`, float64 tensor of shape (timesteps,).

    Args:
        schedule: "linear" - Stable Diffusion's schedule, linspace(sqrt(start), sqrt(end)) ** 2
            (diffusers calls it "scaled_linear", accepted as an alias);
            "cosine" - Nichol & Dhariwal 2021 (arXiv:2102.09672 eq. 17) with offset `cosine_s`,
            betas clipped to 0.999 ("squaredcos_cap_v2" in diffusers, accepted as an alias);
            "sqrt_linear" - linspace(start, end) (what diffusers calls "linear");
            "sqrt" - linspace(start, end) ** 0.5. The last two exist for the original configs.
        timesteps: number of training diffusion steps T.
        linear_start: first beta of the (sqrt_)linear schedules.
        linear_end: last beta of the (sqrt_)linear schedules.
        cosine_s: small offset s of the cosine schedule, keeps beta_0 away from 0.
    """
    if schedule in ("linear", "scaled_linear"):
        return (
            torch.linspace(linear_start**0.5, linear_end**0.5, timesteps, dtype=torch.float64) ** 2
        )
    if schedule in ("cosine", "squaredcos_cap_v2"):
        # abar(t) = f(t) / f(0), f(t) = cos^2((t/T + s) / (1 + s) * pi/2); beta_t = 1 - abar_t / abar_{t-1}.
        steps = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps + cosine_s
        alphas_cumprod = torch.cos(steps / (1 + cosine_s) * math.pi / 2) ** 2
        alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
        betas = 1 - alphas_cumprod[1:] / alphas_cumprod[:-1]
        # The clip keeps beta_T < 1 (abar -> 0 makes the last ratio degenerate), as in the paper.
        return betas.clamp(min=0, max=0.999)
    if schedule == "sqrt_linear":
        return torch.linspace(linear_start, linear_end, timesteps, dtype=torch.float64)
    if schedule == "sqrt":
        return torch.linspace(linear_start, linear_end, timesteps, dtype=torch.float64) ** 0.5
    raise ValueError(f"unknown beta schedule {schedule!r}; expected one of {BETA_SCHEDULES}")


def schedule_betas(
    timesteps: int = 1000,
    beta_schedule: str = "linear",
    linear_start: float = 0.00085,
    linear_end: float = 0.012,
    cosine_s: float = 8e-3,
    zero_terminal_snr: bool = False,
) -> torch.Tensor:
    """The betas of `LatentDiffusion(schedule={...})`: `make_betas`, then optionally rescaled to
    zero terminal SNR (Lin et al. 2023) so the last step is pure noise (use with v-prediction)."""
    betas = make_betas(beta_schedule, timesteps, linear_start, linear_end, cosine_s)
    return rescale_zero_terminal_snr(betas) if zero_terminal_snr else betas


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Rescale betas so that the last step has zero SNR (Lin et al. 2023, arXiv:2305.08891 Alg. 1).

    sqrt(abar) is shifted so its last value is 0 and scaled so its first value is unchanged; the
    returned betas (same dtype as the input) then end with beta_T = 1. Train such schedules with
    v-prediction: at abar_T = 0 an eps model cannot recover x_0.
    """
    sqrt_alphas_cumprod = torch.cumprod(1 - betas, dim=0).sqrt()
    first, last = sqrt_alphas_cumprod[0].clone(), sqrt_alphas_cumprod[-1].clone()
    sqrt_alphas_cumprod = (sqrt_alphas_cumprod - last) * first / (first - last)
    alphas_cumprod = sqrt_alphas_cumprod**2
    alphas = torch.cat([alphas_cumprod[:1], alphas_cumprod[1:] / alphas_cumprod[:-1]])
    return 1 - alphas


def schedule_buffers(betas: torch.Tensor) -> dict[str, torch.Tensor]:
    """The 12 float32 schedule buffers of the original checkpoints, keyed by their original names.

    Computed exactly as CompVis `DDPM.register_schedule` with `v_posterior=0`: float64 maths, one
    cast to float32 at the end. With a zero-terminal-SNR schedule (abar_T = 0) the two
    `sqrt_recip*` buffers end in inf, as they do in the original code.
    """
    betas = betas.to(torch.float64)
    alphas = 1.0 - betas
    alphas_cumprod = torch.cumprod(alphas, dim=0)
    alphas_cumprod_prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
    # Posterior q(x_{t-1} | x_t, x_0) (Ho et al. 2020 eqs. 6-7).
    posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
    buffers = {
        "betas": betas,
        "alphas_cumprod": alphas_cumprod,
        "alphas_cumprod_prev": alphas_cumprod_prev,
        "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
        "sqrt_one_minus_alphas_cumprod": (1.0 - alphas_cumprod).sqrt(),
        "log_one_minus_alphas_cumprod": (1.0 - alphas_cumprod).log(),
        "sqrt_recip_alphas_cumprod": (1.0 / alphas_cumprod).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1.0 / alphas_cumprod - 1).sqrt(),
        "posterior_variance": posterior_variance,
        # The variance is 0 at t=0, hence the clip before the log.
        "posterior_log_variance_clipped": posterior_variance.clamp(min=1e-20).log(),
        "posterior_mean_coef1": betas * alphas_cumprod_prev.sqrt() / (1.0 - alphas_cumprod),
        "posterior_mean_coef2": (1.0 - alphas_cumprod_prev)
        * alphas.sqrt()
        / (1.0 - alphas_cumprod),
    }
    return {name: buffers[name].to(torch.float32) for name in SCHEDULE_BUFFER_NAMES}


def snr(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio abar / (1 - abar) of each timestep (Kingma et al. 2021, arXiv:2107.00630)."""
    return alphas_cumprod / (1 - alphas_cumprod)
