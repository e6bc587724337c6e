"""Ancestral DDPM sampling with the variances a model learned (DiT, Improved DDPM).

A model trained with `learn_sigma` (ldm.dit, trained by ldm.vlb) outputs, beside eps (or v), a
value v per pixel that interpolates the reverse-process variance in log space between the
step's beta and the posterior's beta~ (Nichol & Dhariwal 2021, arXiv:2102.09672, eq. 15). This
is the sampler DiT's `sample.py` runs by default: guided-diffusion's `p_sample_loop` on a
respaced diffusion (`create_diffusion("250")`), without clipping x_0.

Respacing (Improved DDPM sec. 4): sampling visits a subsequence S of the training steps, and the
visited steps form a diffusion of their own with betas 1 - abar_{S_i} / abar_{S_{i-1}}; the mean
and both ends of the variance range are that diffusion's. The network still sees the original
step number S_i. The last step returns the posterior mean with no noise.

Kept apart from ldm.sampling (which registers it as "ddpm_learned") to keep that file short.
"""

import torch

from ldm import vlb


@torch.no_grad()
def sample_ddpm_learned(model, x, timesteps, extra_args=None, callback=None, generator=None):
    """Ancestral DDPM (Ho et al. 2020, Alg. 2) with learned-range variances (Improved DDPM eq. 15).

    model: a `ldm.sampling.Denoiser` whose network returns (B, 2C, H, W): eps or v (as
    `model.parameterization` says), then v for the variance; x: x_t (B, C, H, W) at
    timesteps[0]; timesteps: descending integer training steps (e.g. 999, ..., 0).
    generator: for the noise of every step but the last. callback({"i", "t", "x", "denoised"})
    after every step.
    """
    from ldm.noise import randn_like as _randn_like  # the one rule for drawing noise

    extra_args = extra_args or {}
    timesteps = [int(t) for t in timesteps]
    if sorted(set(timesteps), reverse=True) != timesteps:
        raise ValueError(f"timesteps must be strictly descending, got {timesteps}")
    # The respaced diffusion over the visited steps, in ascending order (index 0 = last step).
    abar = model.alphas_cumprod[timesteps[::-1]]  # (S,) float64
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    q = vlb.posterior(1 - abar / abar_prev)
    channels = x.shape[1]
    for i, t in enumerate(timesteps):
        index = torch.full((x.shape[0],), len(timesteps) - 1 - i, dtype=torch.long)
        out = model.model_fn(x, torch.full_like(index, t).to(x.device), **extra_args)
        if out.shape[1] != 2 * channels:
            raise ValueError(
                f"ddpm_learned needs a model that outputs its variance ({2 * channels} channels, "
                f"learn_sigma: true), got {out.shape[1]}"
            )
        prediction, v = out[:, :channels], out[:, channels:]
        a, b = abar[-1 - i].sqrt().item(), (1 - abar[-1 - i]).sqrt().item()
        if model.parameterization == "eps":
            x0 = (x - b * prediction) / a
        else:  # v = a eps - b x_0, x_t = a x_0 + b eps  =>  x_0 = a x_t - b v
            x0 = a * x - b * prediction
        x = vlb.posterior_mean(q, x0, x, index)
        if i + 1 < len(timesteps):
            log_variance = vlb.learned_range_log_variance(q, v, index)
            x = x + (0.5 * log_variance).exp() * _randn_like(x, generator)
        if callback is not None:
            callback({"i": i, "t": t, "x": x, "denoised": x0})
    return x
