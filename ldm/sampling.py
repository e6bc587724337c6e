"""Samplers for DDPM-trained latent diffusion models, in the style of k-diffusion.

The same trained network is seen two ways:
- timestep space (DDIM, PLMS): x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps at the discrete
  training steps t = 0..T-1;
- sigma space (Euler, Heun, DPM-Solver++): x = x_0 + sigma eps with sigma = sqrt((1 - abar) / abar),
  i.e. x = x_t / sqrt(abar_t) (Karras et al. 2022, arXiv:2206.00364, the "VE" form of the same
  process). A `Denoiser` turns the network into D(x; sigma) ~ x_0 for these samplers.

Samplers are plain functions `sample_xxx(model, x, sigmas_or_timesteps, extra_args=None,
callback=None, ...)`; `sample()` picks one, builds the step schedule, adds classifier-free
guidance and img2img. Step schedules follow diffusers' schedulers so that results match what
Stable Diffusion users get there (see `SamplerSpec.spacing`). Random draws use only the
`torch.Generator` passed in, never the global RNG.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ldm.noise import randn_like as _randn_like
from ldm.sampling_learned import sample_ddpm_learned

PARAMETERIZATIONS = ("eps", "v")
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")


def _per_sample(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B,) scalars -> (B, 1, 1, ...) on x's device and dtype, to scale a batch x."""
    return values.to(x.device, x.dtype).view(-1, *([1] * (x.ndim - 1)))


class Denoiser:
    """A DDPM network (eps or v prediction) seen as a denoiser D(x; sigma) ~ x_0.

    k-diffusion's `CompVisDenoiser` / `CompVisVDenoiser` (Karras et al. 2022, Table 1, sigma_data = 1):
        c_in = 1 / sqrt(sigma^2 + 1)           maps the sigma-space x back to the network's x_t,
        eps: D(x; sigma) = x - sigma * F(c_in x, t(sigma)),
        v:   D(x; sigma) = x / (sigma^2 + 1) - sigma / sqrt(sigma^2 + 1) * F(c_in x, t(sigma)),
    where t(sigma) interpolates linearly in log sigma between the training steps (`quantize`:
    the nearest training step instead). `eps_and_x0` is the same model in timestep space for DDIM
    and PLMS. The per-sample scalars are computed in float64 on the CPU.

    Args:
        model_fn: network(x_t (B, C, H, W), t (B,), **extra_args) -> eps or v, shaped like x_t.
        alphas_cumprod: (T,) abar of the training schedule.
        parameterization: "eps" or "v" - what the network predicts (v = sqrt(abar) eps -
            sqrt(1 - abar) x_0, Salimans & Ho 2022, arXiv:2202.00512).
        quantize: round t(sigma) to the nearest training step (as diffusers' DPMSolverMultistep
            does for Karras sigmas).
    """

    def __init__(
        self,
        model_fn: Callable[..., torch.Tensor],
        alphas_cumprod: torch.Tensor,
        parameterization: str = "eps",
        quantize: bool = False,
    ):
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}"
            )
        self.model_fn = model_fn
        self.parameterization = parameterization
        self.quantize = quantize
        self.alphas_cumprod = alphas_cumprod.detach().to("cpu", torch.float64)
        # abar_T = 0 (zero terminal SNR) would give sigma_max = inf; like diffusers' sigma-space
        # schedulers we use 2**-24 there (sigma ~ 4096).
        abar = self.alphas_cumprod.clamp(min=2**-24)
        self.sigmas = ((1 - abar) / abar).sqrt()  # (T,) increasing with t
        self.log_sigmas = self.sigmas.log()

    @property
    def num_timesteps(self) -> int:
        """Number of training steps T."""
        return self.sigmas.shape[0]

    def sigma_to_t(self, sigma: torch.Tensor) -> torch.Tensor:
        """Continuous training step of each sigma: linear interpolation in log sigma (float64, CPU)."""
        log_sigma = sigma.to("cpu", torch.float64).log()
        if self.quantize:
            return (log_sigma[None] - self.log_sigmas[:, None]).abs().argmin(dim=0).double()
        low = torch.searchsorted(self.log_sigmas, log_sigma, right=True) - 1
        low = low.clamp(0, self.num_timesteps - 2)
        log_low, log_high = self.log_sigmas[low], self.log_sigmas[low + 1]
        w = ((log_low - log_sigma) / (log_low - log_high)).clamp(0, 1)
        return low + w

    def t_to_sigma(self, t: torch.Tensor) -> torch.Tensor:
        """sigma at (possibly fractional) steps t: linear interpolation in sigma (as np.interp in
        diffusers' schedulers); exact at integer t."""
        t = t.to("cpu", torch.float64)
        low = t.floor().long().clamp(0, self.num_timesteps - 2)
        w = t - low
        return (1 - w) * self.sigmas[low] + w * self.sigmas[low + 1]

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args) -> torch.Tensor:
        """D(x; sigma): x (B, C, H, W) in sigma space, sigma (B,) -> predicted x_0 (B, C, H, W)."""
        sigma = sigma.detach().to("cpu", torch.float64).expand(x.shape[0])
        c_in = (sigma**2 + 1).rsqrt()
        t = self.sigma_to_t(sigma).to(x.device, torch.float32)
        out = self.model_fn(x * _per_sample(c_in, x), t, **extra_args)  # (B, C, H, W)
        if self.parameterization == "eps":
            return x - _per_sample(sigma, x) * out
        return x * _per_sample(c_in**2, x) - out * _per_sample(sigma * c_in, x)

    def eps_and_x0(
        self, x: torch.Tensor, t: int, **extra_args
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Timestep space: x_t (B, C, H, W) at integer step t -> (eps, x_0) predictions."""
        abar = float(self.alphas_cumprod[t])
        if abar == 0 and self.parameterization == "eps":
            raise ValueError(
                "an eps-prediction model cannot predict x_0 at zero SNR (abar_t = 0, Lin et al. "
                "2023 sec. 3.2): use a v-prediction model or 'leading' timestep spacing"
            )
        timesteps = torch.full((x.shape[0],), t, dtype=torch.long, device=x.device)
        out = self.model_fn(x, timesteps, **extra_args)  # (B, C, H, W)
        a, b = math.sqrt(abar), math.sqrt(1 - abar)
        if self.parameterization == "eps":
            return out, (x - b * out) / a
        # v = a eps - b x_0 and x_t = a x_0 + b eps  =>  x_0 = a x_t - b v, eps = a v + b x_t.
        return a * out + b * x, a * x - b * out


def classifier_free_guidance(
    model_fn: Callable[..., torch.Tensor],
    uncond: Mapping[str, torch.Tensor],
    scale: float,
    channels: int | None = None,
) -> Callable[..., torch.Tensor]:
    """Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598 eq. 6) around model_fn.

    Returns guided(x, t, cond) = out_uncond + scale * (out_cond - out_uncond), computed in one
    model call on a batch of 2B. The unconditional side is built field by field: each field of
    `uncond` (batch 1 or B: the empty caption's context, the null class, a negative prompt)
    replaces the same field of `cond`; a field `uncond` lacks (e.g. SDXL's size vector) is the
    same on both sides. Guiding the raw output (eps or v) equals guiding x_0, which is affine in it.
    `channels`: guide only the first channels (eps or v of a learned-variance output); the rest,
    the variance, is the conditional side's (as DiT's `forward_with_cfg` + `sample.py`).
    """

    def guided(x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        both = {}
        for field, value in cond.items():
            other = uncond.get(field, value)
            both[field] = torch.cat([other.expand_as(value), value])
        out_uncond, out_cond = model_fn(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
        out = out_uncond + scale * (out_cond - out_uncond)
        return (
            out if channels is None else torch.cat([out[:, :channels], out_cond[:, channels:]], 1)
        )

    return guided


def spaced_timesteps(
    steps: int,
    spacing: str = "leading",
    *,
    steps_offset: int = 1,
    num_train_timesteps: int = 1000,
    integer: bool = True,
    final_to_zero: bool = False,
) -> torch.Tensor:
    """Descending training steps visited by a `steps`-step sampler, float64 (steps,).

    The spacings of Lin et al. 2023 (arXiv:2305.08891, Table 2), computed as diffusers does:
      "leading":  arange(steps) * (T // steps) + steps_offset - Stable Diffusion's DDIM/PLMS
                  (CompVis `make_ddim_timesteps`, "uniform", plus 1): 981, 961, ..., 1 for 50 steps;
      "linspace": linspace(0, T - 1, steps) - both ends: 999, ..., 0; rounded if `integer`;
      "trailing": round(arange(T, 0, -T / steps)) - 1 - ends at T - 1: 999, 979, ..., 19.
    `final_to_zero` is DPM-Solver's variant (diffusers DPMSolverMultistepScheduler): "leading" and
    "linspace" lay out steps + 1 points and drop the lowest, because a final step to sigma = 0
    follows.
    """
    if spacing not in TIMESTEP_SPACINGS:
        raise ValueError(f"timestep spacing must be one of {TIMESTEP_SPACINGS}, got {spacing!r}")
    if not 1 <= steps <= num_train_timesteps:
        raise ValueError(f"steps must be in [1, {num_train_timesteps}], got {steps}")
    points = steps + 1 if final_to_zero else steps
    if spacing == "leading":
        timesteps = np.arange(points)[::-1] * (num_train_timesteps // points) + steps_offset
    elif spacing == "linspace":
        timesteps = np.linspace(0, num_train_timesteps - 1, points)[::-1]
        timesteps = timesteps.round() if integer else timesteps
    else:
        timesteps = np.arange(num_train_timesteps, 0, -num_train_timesteps / steps).round() - 1
    return torch.from_numpy(timesteps[:steps].astype(np.float64))


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> torch.Tensor:
    """Karras et al. 2022 (eq. 5) noise levels, (steps + 1,) float64 ending with 0.

    sigma_i = (sigma_max^(1/rho) + i / (steps - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho.
    """
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    max_inv_rho, min_inv_rho = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    sigmas = (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho
    return torch.cat([sigmas, sigmas.new_zeros(1)])


@torch.no_grad()
def sample_ddim(model, x, timesteps, extra_args=None, callback=None, eta=0.0, generator=None):
    """DDIM (Song et al. 2021, arXiv:2010.02502, eq. 12) in timestep space.

    model: a `Denoiser` (its `eps_and_x0`); x: x_t at timesteps[0]; timesteps: descending integer
    steps. eta = 0 is deterministic DDIM, eta = 1 the DDPM posterior variance. As in CompVis and
    diffusers (`set_alpha_to_one=False`), the last step lands on the noise level of t = 0, not
    abar = 1. callback({"i", "t", "x", "denoised"}) after every step.
    """
    extra_args = extra_args or {}
    timesteps = [int(t) for t in timesteps]
    alphas_cumprod = model.alphas_cumprod
    for i, t in enumerate(timesteps):
        t_prev = timesteps[i + 1] if i + 1 < len(timesteps) else 0
        a_t, a_prev = float(alphas_cumprod[t]), float(alphas_cumprod[t_prev])
        eps, x0 = model.eps_and_x0(x, t, **extra_args)
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
        x = math.sqrt(a_prev) * x0 + math.sqrt(max(1 - a_prev - sigma**2, 0.0)) * eps
        if eta > 0:
            x = x + sigma * _randn_like(x, generator)
        if callback is not None:
            callback({"i": i, "t": t, "x": x, "denoised": x0})
    return x


@torch.no_grad()
def sample_plms(model, x, timesteps, extra_args=None, callback=None):
    """PLMS, the pseudo linear multistep method of PNDM (Liu et al. 2022, arXiv:2202.09778), as in
    CompVis `plms.py`.

    Each step is the deterministic DDIM step (the paper's "transfer" eq. 9) with eps replaced by an
    Adams-Bashforth combination of the current and up to 3 previous eps predictions (eq. 12). The
    first step has no history and takes a pseudo improved Euler step instead: one extra model call
    at the next step, eps averaged. diffusers' PNDMScheduler(skip_prk_steps=True) computes the same
    for eps models (it averages raw v outputs; we convert each to eps first). Arguments as
    `sample_ddim`.
    """
    extra_args = extra_args or {}
    timesteps = [int(t) for t in timesteps]
    alphas_cumprod = model.alphas_cumprod
    if alphas_cumprod[timesteps[0]] == 0:
        # The multistep eps combination must be turned back into x_0, dividing by sqrt(abar_t).
        raise ValueError(
            "plms cannot start at zero SNR (abar_t = 0): use ddim or 'leading' spacing"
        )

    def ddim_step(x, eps, t, t_prev):
        a_t, a_prev = float(alphas_cumprod[t]), float(alphas_cumprod[t_prev])
        x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
        return math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps, x0

    old_eps = []
    for i, t in enumerate(timesteps):
        is_last = i + 1 == len(timesteps)
        t_prev = 0 if is_last else timesteps[i + 1]
        eps, _ = model.eps_and_x0(x, t, **extra_args)
        if not old_eps and not is_last:
            x_next, _ = ddim_step(x, eps, t, t_prev)
            eps_next, _ = model.eps_and_x0(x_next, t_prev, **extra_args)
            eps_prime = (eps + eps_next) / 2
        elif not old_eps:
            eps_prime = eps
        elif len(old_eps) == 1:
            eps_prime = (3 * eps - old_eps[-1]) / 2
        elif len(old_eps) == 2:
            eps_prime = (23 * eps - 16 * old_eps[-1] + 5 * old_eps[-2]) / 12
        else:
            eps_prime = (55 * eps - 59 * old_eps[-1] + 37 * old_eps[-2] - 9 * old_eps[-3]) / 24
        x, x0 = ddim_step(x, eps_prime, t, t_prev)
        old_eps = (old_eps + [eps])[-3:]
        if callback is not None:
            callback({"i": i, "t": t, "x": x, "denoised": x0})
    return x


def _sigma_batch(x: torch.Tensor, sigma: float) -> torch.Tensor:
    return torch.full((x.shape[0],), sigma, dtype=torch.float64)


def _derivative(x: torch.Tensor, sigma: float, denoised: torch.Tensor) -> torch.Tensor:
    """dx/dsigma of the probability-flow ODE, (x - D(x; sigma)) / sigma (Karras et al. eq. 3)."""
    return (x - denoised) / sigma


@torch.no_grad()
def sample_euler(model, x, sigmas, extra_args=None, callback=None):
    """Euler method on the probability-flow ODE (Karras et al. 2022, Alg. 2 without its 2nd-order
    correction and without churn).

    model: a `Denoiser`; x: the sample at sigmas[0]; sigmas: descending noise levels ending at 0.
    callback({"i", "sigma", "x", "denoised"}) after every step.
    """
    extra_args = extra_args or {}
    sigmas = [float(s) for s in sigmas]
    for i, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        denoised = model(x, _sigma_batch(x, sigma), **extra_args)
        x = x + _derivative(x, sigma, denoised) * (sigma_next - sigma)
        if callback is not None:
            callback({"i": i, "sigma": sigma, "x": x, "denoised": denoised})
    return x


@torch.no_grad()
def sample_euler_ancestral(
    model, x, sigmas, extra_args=None, callback=None, eta=1.0, generator=None
):
    """Ancestral sampling with Euler steps (k-diffusion `sample_euler_ancestral`).

    Each step goes down to sigma_down with an Euler step, then adds fresh noise sigma_up so the
    marginal noise level is sigma_next: sigma_up = eta * sqrt(sigma_next^2 (sigma^2 -
    sigma_next^2) / sigma^2) (the DDPM posterior, Ho et al. 2020), sigma_down = sqrt(sigma_next^2 -
    sigma_up^2). Noise comes from `generator` only. Other arguments as `sample_euler`.
    """
    extra_args = extra_args or {}
    sigmas = [float(s) for s in sigmas]
    for i, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        denoised = model(x, _sigma_batch(x, sigma), **extra_args)
        sigma_up = min(
            sigma_next, eta * math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
        )
        sigma_down = math.sqrt(sigma_next**2 - sigma_up**2)
        x = x + _derivative(x, sigma, denoised) * (sigma_down - sigma)
        if sigma_next > 0:
            x = x + _randn_like(x, generator) * sigma_up
        if callback is not None:
            callback({"i": i, "sigma": sigma, "x": x, "denoised": denoised})
    return x


@torch.no_grad()
def sample_heun(model, x, sigmas, extra_args=None, callback=None):
    """Heun's 2nd-order method on the probability-flow ODE (Karras et al. 2022, Alg. 1).

    An Euler step to sigma_next, then the derivative there is averaged with the first one; the
    last step (to sigma = 0, where the derivative is undefined) stays Euler. Two model calls per
    step. Arguments as `sample_euler`.
    """
    extra_args = extra_args or {}
    sigmas = [float(s) for s in sigmas]
    for i, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        denoised = model(x, _sigma_batch(x, sigma), **extra_args)
        d = _derivative(x, sigma, denoised)
        if sigma_next == 0:
            x = x + d * (sigma_next - sigma)
        else:
            x_euler = x + d * (sigma_next - sigma)
            denoised_next = model(x_euler, _sigma_batch(x, sigma_next), **extra_args)
            d_next = _derivative(x_euler, sigma_next, denoised_next)
            x = x + (d + d_next) / 2 * (sigma_next - sigma)
        if callback is not None:
            callback({"i": i, "sigma": sigma, "x": x, "denoised": denoised})
    return x


@torch.no_grad()
def sample_dpmpp_2m(model, x, sigmas, extra_args=None, callback=None):
    """DPM-Solver++(2M), the 2nd-order multistep solver (Lu et al. 2022, arXiv:2211.01095 Alg. 2).

    With lambda = -log sigma and h = lambda_next - lambda:
      x_next = (sigma_next / sigma) x - expm1(-h) D,  D = (1 + 1/(2r)) x0_i - 1/(2r) x0_{i-1},
    r = h_prev / h; the first step (no history) and the last one (to sigma = 0) are 1st order
    (D = x0_i), as in k-diffusion and diffusers' DPMSolverMultistepScheduler. Arguments as
    `sample_euler`.
    """
    extra_args = extra_args or {}
    sigmas = [float(s) for s in sigmas]
    old_denoised, h_prev = None, None
    for i, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        denoised = model(x, _sigma_batch(x, sigma), **extra_args)
        if sigma_next == 0:
            x = denoised
        else:
            h = math.log(sigma) - math.log(sigma_next)
            if old_denoised is None:
                d = denoised
            else:
                r = h_prev / h
                d = (1 + 1 / (2 * r)) * denoised - 1 / (2 * r) * old_denoised
            x = (sigma_next / sigma) * x - math.expm1(-h) * d
            h_prev = h
        old_denoised = denoised
        if callback is not None:
            callback({"i": i, "sigma": sigma, "x": x, "denoised": denoised})
    return x


@dataclass(frozen=True)
class SamplerSpec:
    """How `sample()` runs a sampler.

    space: "timestep" (x_t at training steps: DDIM, PLMS) or "sigma" (the Karras ODE form).
    spacing: diffusers' default timestep spacing for Stable Diffusion's scheduler config (which
        names none, only `steps_offset: 1`): DDIMScheduler and PNDMScheduler (= PLMS) default to
        "leading", EulerDiscrete, EulerAncestralDiscrete, HeunDiscrete and DPMSolverMultistep to
        "linspace".
    options: the optional arguments of `fn` that `sample()` hands on ("eta", "generator").
    dpm_solver: DPM-Solver's step layout (integer steps, a final step to sigma = 0, t rounded to
        training steps for Karras sigmas; diffusers' DPMSolverMultistepScheduler).
    """

    fn: Callable
    space: str
    spacing: str
    options: tuple[str, ...] = ()
    dpm_solver: bool = False
    learned_variance: bool = False  # the network's output carries v (ldm.sampling_learned)


SAMPLER_SPECS = {
    "ddim": SamplerSpec(sample_ddim, "timestep", "leading", ("eta", "generator")),
    "plms": SamplerSpec(sample_plms, "timestep", "leading"),
    "euler": SamplerSpec(sample_euler, "sigma", "linspace"),
    "euler_a": SamplerSpec(sample_euler_ancestral, "sigma", "linspace", ("generator",)),
    "heun": SamplerSpec(sample_heun, "sigma", "linspace"),
    "dpmpp_2m": SamplerSpec(sample_dpmpp_2m, "sigma", "linspace", dpm_solver=True),
    # DiT's sample.py: guided-diffusion's linspace-like respacing, learned variances.
    "ddpm_learned": SamplerSpec(
        sample_ddpm_learned, "timestep", "linspace", ("generator",), learned_variance=True
    ),
}
SAMPLERS = tuple(SAMPLER_SPECS)


def sampler_sigmas(
    denoiser: Denoiser,
    steps: int,
    sampler: str = "euler",
    spacing: str = "linspace",
    steps_offset: int = 1,
    karras: bool = False,
) -> torch.Tensor:
    """The (steps + 1,) descending noise levels, ending with 0, that diffusers' scheduler for
    `sampler` visits: the training steps of `spaced_timesteps` mapped to sigma (fractional ones
    for Euler/Heun "linspace", integers with DPM-Solver's `final_to_zero` layout for dpmpp_2m), or
    with `karras` Karras sigmas between the schedule's sigma_min and sigma_max (then `spacing` is
    not used; diffusers' Euler schedulers take the spaced steps' end points instead, which is the
    same for "linspace").
    """
    if karras:
        return karras_sigmas(steps, float(denoiser.sigmas[0]), float(denoiser.sigmas[-1]))
    timesteps = spaced_timesteps(
        steps,
        spacing,
        steps_offset=steps_offset,
        num_train_timesteps=denoiser.num_timesteps,
        integer=SAMPLER_SPECS[sampler].dpm_solver,
        final_to_zero=SAMPLER_SPECS[sampler].dpm_solver,
    )
    sigmas = denoiser.t_to_sigma(timesteps)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _check_sample_args(sampler, eta, karras, scale, uncond, init_latent, strength, noise):
    if sampler not in SAMPLER_SPECS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    spec = SAMPLER_SPECS[sampler]
    if eta != 0 and "eta" not in spec.options:
        raise ValueError(f"eta only applies to sampler='ddim', got eta={eta} with {sampler!r}")
    if karras and spec.space != "sigma":
        sigma_samplers = tuple(n for n, s in SAMPLER_SPECS.items() if s.space == "sigma")
        raise ValueError(f"karras sigmas need a sigma-space sampler {sigma_samplers}")
    if scale != 1.0 and uncond is None:
        raise ValueError("guidance scale != 1 needs uncond (e.g. the empty prompt's conditioning)")
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1], got {strength}")
    if init_latent is None and strength != 1.0:
        raise ValueError("strength < 1 is img2img and needs init_latent")
    if init_latent is not None and init_latent.shape != noise.shape:
        raise ValueError(f"init_latent {tuple(init_latent.shape)} != noise {tuple(noise.shape)}")


@torch.no_grad()
def sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    noise: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    *,
    sampler: str = "ddim",
    steps: int = 50,
    cond: Mapping[str, torch.Tensor],
    uncond: Mapping[str, torch.Tensor] | None = None,
    scale: float = 1.0,
    parameterization: str = "eps",
    eta: float = 0.0,
    karras: bool = False,
    generator: torch.Generator | None = None,
    init_latent: torch.Tensor | None = None,
    strength: float = 1.0,
    callback: Callable[[dict], None] | None = None,
    timestep_spacing: str | None = None,
    steps_offset: int = 1,
) -> torch.Tensor:
    """Sample latents x_0 (B, C, H, W) from a DDPM-trained network.

    Args:
        model_fn: network(x_t, t, cond) -> raw output (eps or v) shaped like x_t (for
            "ddpm_learned": then the variance v, 2C channels); t is a (B,)
            tensor of training steps in [0, T-1] - int64 for ddim/plms, float32 (fractional
            between training steps) for the sigma-space samplers.
        noise: (B, C, H, W) standard normal noise; the start of txt2img, the noise added to
            init_latent for img2img.
        alphas_cumprod: (T,) abar of the training schedule (the model's buffer).
        sampler: one of SAMPLERS: "ddim", "plms", "euler", "euler_a", "heun", "dpmpp_2m",
            "ddpm_learned" (learned variances, ldm.sampling_learned).
        steps: number of sampling steps (plms and heun make extra model calls).
        cond: the conditioning fields, e.g. {"crossattn": (B, L, D)} or {"y": (B,)}.
        uncond: the unconditional side of classifier-free guidance, field by field (batch 1 or
            B): the empty or negative prompt's context, the null class; used when scale != 1.
        scale: classifier-free guidance scale; 1 = conditional model only.
        parameterization: "eps" or "v", what the network predicts.
        eta: DDIM noise (0 deterministic, 1 DDPM-like); ddim only.
        karras: Karras et al. noise levels for the sigma-space samplers.
        generator: torch.Generator for every random draw (euler_a, ddpm_learned, ddim with eta > 0).
        init_latent: (B, C, H, W) latent to start from for img2img (SDEdit, Meng et al. 2022,
            arXiv:2108.01073).
        strength: img2img strength: noise init_latent to the level of the last
            int(steps * strength) steps and run only those (diffusers' rule); 0 returns
            init_latent unchanged, 1 ignores it (plain txt2img).
        callback: called with a dict {"i", "x", "denoised", and "t" or "sigma"} after each step.
        timestep_spacing: "leading", "linspace" or "trailing"; None = the sampler's default
            (`SamplerSpec.spacing`, diffusers' default for Stable Diffusion's scheduler config).
        steps_offset: added to "leading" timesteps; 1 in Stable Diffusion's configs.
    """
    _check_sample_args(sampler, eta, karras, scale, uncond, init_latent, strength, noise)
    spec = SAMPLER_SPECS[sampler]
    guided = model_fn
    if uncond is not None and scale != 1.0:
        channels = noise.shape[1] if spec.learned_variance else None
        guided = classifier_free_guidance(model_fn, uncond, scale, channels)

    def network(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return guided(x, t, cond)

    spacing = timestep_spacing or spec.spacing
    img2img = init_latent is not None and strength < 1.0
    # img2img runs the last int(steps * strength) steps of the full schedule (diffusers' rule).
    skipped = steps - min(int(steps * strength), steps) if img2img else 0
    if skipped == steps:
        return init_latent.clone()
    options = {"eta": eta, "generator": generator}
    options = {name: options[name] for name in spec.options}

    if spec.space == "timestep":
        denoiser = Denoiser(network, alphas_cumprod, parameterization)
        timesteps = spaced_timesteps(
            steps, spacing, steps_offset=steps_offset, num_train_timesteps=len(alphas_cumprod)
        )[skipped:]
        x = noise
        if img2img:  # q(x_t | x_0) at the first step that is run
            abar = float(denoiser.alphas_cumprod[int(timesteps[0])])
            x = math.sqrt(abar) * init_latent + math.sqrt(1 - abar) * noise
        return spec.fn(denoiser, x, timesteps, callback=callback, **options)

    # diffusers' DPMSolverMultistep rounds Karras steps to integer t (a no-op otherwise).
    denoiser = Denoiser(network, alphas_cumprod, parameterization, quantize=spec.dpm_solver)
    sigmas = sampler_sigmas(denoiser, steps, sampler, spacing, steps_offset, karras)[skipped:]
    sigma_max = float(sigmas[0])
    if img2img:
        x = init_latent + noise * sigma_max
    elif spec.dpm_solver or spacing == "leading":
        # Unit-variance noise in timestep space, x_T = noise, is x = noise * sqrt(sigma^2 + 1) here
        # (what DDIM and DPM-Solver start from).
        x = noise * math.sqrt(sigma_max**2 + 1)
    else:
        # diffusers' Euler/Heun schedulers (and k-diffusion) start from noise * sigma_max for
        # "linspace"/"trailing" spacing; 0.2% less at SD's sigma_max = 14.6.
        x = noise * sigma_max
    return spec.fn(denoiser, x, sigmas, callback=callback, **options)
