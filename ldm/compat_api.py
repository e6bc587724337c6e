"""The original CompVis / Stability-AI Python API, as thin adapters over the named conditioning.

Scripts and wrappers written for the original `LatentDiffusion` (the original
`scripts/txt2img.py`, k-diffusion's `CompVisDenoiser`, AUTOMATIC1111-style code) call:

    c = model.get_learned_conditioning(prompts)          # (B, T, D) text context
    eps = model.apply_model(x, t, c)                     # a bare tensor is the context
    eps = model.model.diffusion_model(x, t, c)           # UNet forward(x, timesteps, context)
    x_t = model.q_sample(x0, t, noise)
    z = model.get_first_stage_encoding(model.encode_first_stage(images))
    images = model.decode_first_stage(z)
    model.alphas_cumprod                                 # (T,) the DDPM schedule

Here conditioning is a dict of named tensors (`ldm.conditioning.FIELDS`). This module is the one
place that turns the original forms into it (`named_conditioning`) and holds the original
methods that ours do not already provide (`CompVisAPI`, mixed into `LatentDiffusion`).
"""

from collections.abc import Mapping

import torch

from ldm.autoencoder import DiagonalGaussianDistribution


def named_conditioning(cond=None, context=None, y=None) -> dict[str, torch.Tensor]:
    """Conditioning in any of the original forms -> `{"crossattn", "vector", "y"}`.

    - our dict (also sgm's: its keys are ours) is returned unchanged;
    - a bare tensor, or a list of tensors, is the cross-attention context (CompVis
      `apply_model(x, t, c)` wraps `c` in a list; a list is joined along the tokens, as its
      `DiffusionWrapper` does with `c_crossattn`);
    - CompVis' `{"c_crossattn": [c], "c_adm": y}` dict;
    - the UNet's keywords `context=` (cross-attention) and `y=` (class ids, or SDXL's vector).
    """
    if isinstance(cond, Mapping) and context is None and y is None:
        if "c_crossattn" not in cond and "c_concat" not in cond and "c_adm" not in cond:
            return cond  # ours: the training path pays one isinstance
    named = {}
    if isinstance(cond, Mapping) and ("c_crossattn" in cond or "c_concat" in cond):
        if cond.get("c_concat") is not None:
            raise ValueError(
                "c_concat conditioning (inpainting / depth models) is not supported here"
            )
        context = cond.get("c_crossattn") if context is None else context
        y = cond.get("c_adm") if y is None else y
    elif isinstance(cond, Mapping):
        named.update(cond)
    elif cond is not None:
        context = cond if context is None else context
    if isinstance(context, (list, tuple)):
        context = torch.cat(list(context), dim=1)  # (B, T1 + T2 + ..., D)
    if context is not None:
        named["crossattn"] = context
    if y is not None:
        # sgm names a float (B, D) vector `y` as well; ours calls it `vector`.
        named["y" if not torch.is_floating_point(y) else "vector"] = y
    return named


class CompVisAPI:
    """The original `LatentDiffusion` methods, for a module that has ours (`conditioning`,
    `conditioner`, `scale_factor`, the schedule buffers). `apply_model`, `encode_first_stage`,
    `decode_first_stage` and `alphas_cumprod` are the module's own; its `apply_model` takes the
    original forms through `named_conditioning`."""

    def get_learned_conditioning(self, c):
        """Prompts (or class ids) -> the context tensor (B, T, D) as the original returns it; a
        conditioner with more fields than the cross-attention context (SDXL) gives the dict,
        which `apply_model` takes as well. Gradients flow where the conditioner trains (as in
        the original, which textual-inversion code relies on)."""
        cond = self.conditioning(self.conditioner.batch_of(c))
        return cond["crossattn"] if set(cond) == {"crossattn"} else cond

    def get_first_stage_encoding(self, encoder_posterior) -> torch.Tensor:
        """A posterior -> scaled latent sample (`scale_factor * z`, as the original; with a
        first stage that has a shift, `(z - shift_factor) * scale_factor`: `scale_latents`).

        Our `encode_first_stage` already returns the scaled sample, so a tensor passes through
        unchanged: `get_first_stage_encoding(encode_first_stage(x))` is the original's value."""
        if isinstance(encoder_posterior, DiagonalGaussianDistribution):
            return self.scale_latents(encoder_posterior.sample())
        if isinstance(encoder_posterior, torch.Tensor):
            return encoder_posterior
        raise TypeError(f"encoder_posterior of type {type(encoder_posterior).__name__}")

    def q_sample(
        self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (Ho et al. 2020, eq. 4)."""
        noise = torch.randn_like(x_start) if noise is None else noise
        shape = (-1,) + (1,) * (x_start.dim() - 1)
        a = self.sqrt_alphas_cumprod[t].view(shape).to(x_start.dtype)
        s = self.sqrt_one_minus_alphas_cumprod[t].view(shape).to(x_start.dtype)
        return a * x_start + s * noise
