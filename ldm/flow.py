"""Rectified flow: the objective and its samplers (Esser et al. 2024, "Scaling Rectified Flow
Transformers for High-Resolution Image Synthesis", arXiv:2403.03206 - Stable Diffusion 3).

The forward process is a straight line from data to noise (sec. 2, eq. 3 with a_t = 1 - t, b_t = t):
    x_t = (1 - t) x_0 + t e,    t in [0, 1],
and the network predicts its velocity v = dx_t/dt = e - x_0 (the conditional flow matching loss,
eq. 1). Sampling integrates dx/dt = v(x, t) from t = 1 (pure noise) to t = 0. The backbone sees
the time as t * 1000 (SD3's convention), so any backbone made for DDPM steps works unchanged.

Samplers are plain functions in the k-diffusion style, `sample_flow_xxx(model, x, sigmas,
extra_args=None, callback=None)` with `model(x, sigma) -> velocity`; `sample()` builds the step
schedule as diffusers' `FlowMatchEulerDiscreteScheduler` does (SD3's scheduler), adds
classifier-free guidance and img2img. Random draws use only the `torch.Generator` passed in.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from ldm.config_errors import is_number
from ldm.sampling import classifier_free_guidance

TIMESTEP_SAMPLINGS = ("logit_normal", "mode", "uniform")
FLOW_SAMPLERS = ("euler", "heun")
# DDIM with eta = 0 on x_t = (1 - t) x_0 + t e is exactly the flow Euler step (both keep the
# predicted x_0 and e and move t), so the DDPM samplers' default name means flow Euler here.
SAMPLER_ALIASES = {"ddim": "euler"}


# --- the objective -----------------------------------------------------------------------------
def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x_0 + t e (eq. 3 of the paper with the rectified-flow choice a_t = 1 - t,
    b_t = t); t (B,) in [0, 1]."""
    t = t.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


def velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The training target: v = d x_t / dt = e - x_0."""
    return noise - x0


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The resolution-dependent shift (sec. 5.3.2): t' = shift t / (1 + (shift - 1) t), i.e.
    sqrt(m/n) with m/n the ratio of pixel counts; SD3 uses shift = 3.0 at 1024 px. shift > 1
    moves time toward noise (more noise is needed to destroy a larger image)."""
    return shift * t / (1 + (shift - 1) * t)


def logit_normal(n, mean, std, generator=None, device=None) -> torch.Tensor:
    """t = sigmoid(u), u ~ N(mean, std) (sec. 3.1, eq. 19): more weight on the middle of the path."""
    u = torch.randn(n, generator=generator, device=device)
    return torch.sigmoid(mean + std * u)


def mode_heavy_tails(n, scale, generator=None, device=None) -> torch.Tensor:
    """t = f_mode(u) = 1 - u - s (cos^2(pi/2 u) - 1 + u), u ~ U(0, 1) (sec. 3.1, eq. 20): a mode
    in the middle that keeps density at the ends; s = 0 is uniform."""
    u = torch.rand(n, generator=generator, device=device)
    return 1 - u - scale * (torch.cos(math.pi / 2 * u) ** 2 - 1 + u)


def dynamic_shift(
    image_seq_len: int,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_image_seq_len: int = 256,
    max_image_seq_len: int = 4096,
) -> float:
    """Flux's image-size-dependent shift (BFL `src/flux/sampling.py` get_lin_function / get_schedule;
    diffusers' `calculate_shift` with `use_dynamic_shifting`): mu on the line through
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift) - 256 and 4096 tokens are
    256 px and 1024 px images - and shift = exp(mu). BFL's time_shift exp(mu) / (exp(mu) + 1/t - 1)
    is `shift_time(t, exp(mu))`. The same idea as SD3's sqrt(m/n) (sec. 5.3.2), fitted by BFL."""
    slope = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len)
    return math.exp(base_shift + slope * (image_seq_len - base_image_seq_len))


@dataclass(frozen=True)
class FlowSchedule:
    """How training draws t, from `model.params.schedule` of a `parameterization: flow` model.

    timestep_sampling: "logit_normal" (logit_mean, logit_std; the paper's best, rf/lognorm(0, 1)),
    "mode" (mode_scale; eq. 20) or "uniform"; shift: the resolution shift applied to the drawn t
    (training) and to the sampling steps (1.0 = none; SD3 at 1024 px: 3.0).

    use_dynamic_shifting: instead of the one `shift`, each batch's own from its latent size
    (`dynamic_shift` of its token count, a token being a patch_size x patch_size patch of the
    latent): Flux's rule, so that a bucketed data set's sizes each get theirs. base_shift,
    max_shift, base_image_seq_len, max_image_seq_len: its line (Flux's defaults; diffusers'
    FlowMatchEulerDiscreteScheduler names). Sampling then uses BFL's step grid (`flux_sigmas`).

    shift_sampling: false samples on the unshifted grid (training's times stay shifted): a model
    distilled to sample on it, as FLUX.1 [schnell] - BFL's cli.py samples it with
    `get_schedule(..., shift=(name != "flux-schnell"))`, diffusers' schnell scheduler config
    has shift 1.0 and no dynamic shifting. The schnell config says so.
    """

    timestep_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    patch_size: int = 2
    shift_sampling: bool = True

    @classmethod
    def from_config(cls, config: Mapping | None) -> "FlowSchedule":
        """`model.params.schedule` -> the schedule; a mistyped key or a value of the wrong type
        is a ValueError naming `schedule.<key>` (not a TypeError from the constructor)."""
        config = {} if config is None else config
        known = [field.name for field in fields(cls)]
        if not isinstance(config, Mapping):
            raise ValueError(f"schedule: expected a mapping of {', '.join(known)}, got {config!r}")
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"schedule.{unknown[0]}: unknown key; known: {', '.join(known)}")
        return cls(**config)

    def __post_init__(self):
        self._check_types()
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(
                f"schedule.timestep_sampling must be one of {TIMESTEP_SAMPLINGS}, "
                f"got {self.timestep_sampling!r}"
            )
        if not self.shift > 0:
            raise ValueError(f"schedule.shift must be > 0, got {self.shift}")
        if self.logit_std <= 0:
            raise ValueError(f"schedule.logit_std must be > 0, got {self.logit_std}")
        # f_mode maps [0, 1] onto [0, 1] monotonically only for -1 <= s <= 2 / (pi - 2) (eq. 20).
        if not -1 <= self.mode_scale <= 2 / (math.pi - 2):
            raise ValueError(
                f"schedule.mode_scale must be in [-1, {2 / (math.pi - 2):.3f}], got {self.mode_scale}"
            )
        if self.use_dynamic_shifting and not self.max_image_seq_len > self.base_image_seq_len:
            raise ValueError(
                "schedule.max_image_seq_len must be > schedule.base_image_seq_len, got "
                f"{self.max_image_seq_len} and {self.base_image_seq_len}"
            )

    def _check_types(self) -> None:
        """Numbers where numbers go, true / false where a switch goes: read from YAML or the
        command line, `shift: abc` would otherwise fail inside the first training step."""
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type is bool and not isinstance(value, bool):
                raise ValueError(f"schedule.{field.name} must be true or false, got {value!r}")
            number = is_number(value)
            if field.type is float and not number:
                raise ValueError(f"schedule.{field.name} must be a number, got {value!r}")
            if field.type is int and not (number and value >= 1 and float(value).is_integer()):
                raise ValueError(
                    f"schedule.{field.name} must be a whole number >= 1, got {value!r}"
                )

    def shift_for(self, latent_size: Sequence[int] | None = None) -> float:
        """The shift of a batch of latents of `latent_size` (h, w): the fixed `shift`, or with
        use_dynamic_shifting the one of its token count."""
        if not self.use_dynamic_shifting:
            return self.shift
        if latent_size is None:
            raise ValueError("use_dynamic_shifting needs the latent size (h, w) of the batch")
        h, w = latent_size[-2:]
        return dynamic_shift(
            (h // self.patch_size) * (w // self.patch_size),
            self.base_shift,
            self.max_shift,
            self.base_image_seq_len,
            self.max_image_seq_len,
        )

    def sample_t(
        self, n: int, generator=None, device=None, latent_size: Sequence[int] | None = None
    ) -> torch.Tensor:
        """(n,) training times in [0, 1], drawn and then shifted (by the batch's latent size
        (h, w) with use_dynamic_shifting)."""
        if self.timestep_sampling == "logit_normal":
            t = logit_normal(n, self.logit_mean, self.logit_std, generator, device)
        elif self.timestep_sampling == "mode":
            t = mode_heavy_tails(n, self.mode_scale, generator, device)
        else:
            t = torch.rand(n, generator=generator, device=device)
        return shift_time(t, self.shift_for(latent_size))

    def sigmas(
        self, steps: int, latent_size: Sequence[int] | None = None, num_train_timesteps: int = 1000
    ) -> torch.Tensor:
        """(steps + 1,) sampling times from 1 to 0 for latents of `latent_size`: SD3's grid with
        the fixed shift, BFL's with use_dynamic_shifting; unshifted without shift_sampling."""
        shift = self.shift_for(latent_size) if self.shift_sampling else 1.0
        if self.use_dynamic_shifting:
            return flux_sigmas(steps, shift)
        return flow_sigmas(steps, shift, num_train_timesteps)


# --- samplers ------------------------------------------------------------------------------------
def flow_sigmas(steps: int, shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """(steps + 1,) times from 1 down to 0, as diffusers' FlowMatchEulerDiscreteScheduler makes
    them for SD3: `steps` points evenly spaced from 1 to the shifted smallest training time
    shift(1/T), each then shifted, and a final 0."""
    t_min = shift_time(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float64), shift)
    grid = torch.linspace(1.0, float(t_min), steps, dtype=torch.float64)
    return torch.cat([shift_time(grid, shift), grid.new_zeros(1)]).float()


def flux_sigmas(steps: int, shift: float) -> torch.Tensor:
    """(steps + 1,) times from 1 down to 0 as BFL's get_schedule makes them for Flux: steps + 1
    points evenly spaced from 1 to 0, each shifted (diffusers' FluxPipeline: its sigmas
    linspace(1, 1/steps, steps) shifted by its scheduler, then 0)."""
    grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return shift_time(grid, shift).float()


@torch.no_grad()
def sample_flow_euler(model, x, sigmas, extra_args=None, callback=None):
    """Euler's method on the flow ODE dx/dt = v(x, t), from sigmas[0] down to sigmas[-1] = 0:
    x <- x + (t_next - t) v (t_next < t, so the step moves against v = e - x_0, toward data)."""
    extra_args = extra_args or {}
    for i in range(len(sigmas) - 1):
        v = model(x, sigmas[i] * x.new_ones(x.shape[0]), **extra_args)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
        if callback is not None:
            callback({"i": i, "x": x, "sigma": sigmas[i], "velocity": v})
    return x


@torch.no_grad()
def sample_flow_heun(model, x, sigmas, extra_args=None, callback=None):
    """Heun's method (2nd order; Karras et al. 2022, Alg. 1 with the velocity as the derivative)
    on dx/dt = v(x, t); the last step, to t = 0, is an Euler step (as k-diffusion's sample_heun)."""
    extra_args = extra_args or {}
    ones = x.new_ones(x.shape[0])
    for i in range(len(sigmas) - 1):
        dt = sigmas[i + 1] - sigmas[i]
        v = model(x, sigmas[i] * ones, **extra_args)
        x_euler = x + dt * v
        if sigmas[i + 1] == 0:
            x = x_euler
        else:
            v_next = model(x_euler, sigmas[i + 1] * ones, **extra_args)
            x = x + dt * (v + v_next) / 2
        if callback is not None:
            callback({"i": i, "x": x, "sigma": sigmas[i], "velocity": v})
    return x


SAMPLERS = {"euler": sample_flow_euler, "heun": sample_flow_heun}


@torch.no_grad()
def sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    noise: torch.Tensor,
    *,
    sampler: str = "euler",
    steps: int = 28,
    shift: float = 1.0,
    cond: Mapping[str, torch.Tensor],
    uncond: Mapping[str, torch.Tensor] | None = None,
    scale: float = 1.0,
    init_latent: torch.Tensor | None = None,
    strength: float = 1.0,
    callback: Callable[[dict], None] | None = None,
    num_train_timesteps: int = 1000,
    sigmas: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latents x_0 from a velocity network: model_fn(x_t, t * T, cond) -> v, t (B,) float.

    sampler: "euler" or "heun" ("ddim" is Euler, see SAMPLER_ALIASES); shift: the resolution
    shift of the steps (or `sigmas`, the (steps + 1,) times from 1 to 0 themselves, e.g.
    `FlowSchedule.sigmas`); scale: classifier-free guidance (Ho & Salimans 2022) on the velocity,
    which is affine in x_0, with `uncond` field by field (`ldm.sampling.classifier_free_guidance`);
    init_latent, strength: img2img (SDEdit) - run the last int(steps * strength) steps from
    x = (1 - t) init_latent + t noise, diffusers' SD3 img2img rule.
    """
    name = SAMPLER_ALIASES.get(sampler, sampler)
    if name not in SAMPLERS:
        raise ValueError(
            f"sampler {sampler!r} is not a flow sampler: a flow model samples with {FLOW_SAMPLERS}"
        )
    if scale != 1.0 and uncond is None:
        raise ValueError("guidance scale != 1 needs uncond (e.g. the empty prompt's conditioning)")
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1], got {strength}")
    guided = model_fn
    if uncond is not None and scale != 1.0:
        guided = classifier_free_guidance(model_fn, uncond, scale)

    def velocity_model(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return guided(x, sigma * num_train_timesteps, cond)

    if sigmas is None:
        sigmas = flow_sigmas(steps, shift, num_train_timesteps)
    x = noise
    if init_latent is not None and strength < 1.0:
        run = min(int(steps * strength), steps)
        if run == 0:
            return init_latent.clone()
        sigmas = sigmas[steps - run :]
        x = noised(init_latent, noise, sigmas[:1].expand(noise.shape[0]))
    return SAMPLERS[name](velocity_model, x, sigmas.tolist(), callback=callback)
