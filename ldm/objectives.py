"""The objective: what the backbone learns to predict, and everything that follows from it.

One small class per objective, behind one interface (`Objective`):

- `Eps`: the noise e of x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) e (Ho et al. 2020,
  arXiv:2006.11239, eq. 4; SD 1.x, SD 2.x-base).
- `V`: the velocity v = sqrt(abar_t) e - sqrt(1 - abar_t) x_0 of the same process (Salimans & Ho
  2022, arXiv:2202.00512, sec. 4; SD 2.x-768).
- `RectifiedFlow`: the velocity e - x_0 of x_t = (1 - t) x_0 + t e (Esser et al. 2024,
  arXiv:2403.03206; SD3; the maths and samplers are `ldm.flow`).
- `LearnedVariance(Eps | V)`: the backbone also outputs the reverse-process variance, trained by
  the variational bound (Nichol & Dhariwal 2021, arXiv:2102.09672; DiT; `ldm.vlb`).

Each owns the timestep distribution (`sample_t`), the noise (`draw_noise`, with offset noise),
the noised input and the target, the loss weighting (min-SNR-gamma) and how a sampler reads the
backbone's output (`sample`: eps/v through a denoiser, flow as a velocity). `LatentDiffusion`
calls these and never asks which objective it holds.

Times are in the backbone's units throughout: DDPM steps 0..T-1, and flow time t in [0, 1] as
t * T (SD3's convention). The DDPM schedule's tensors are the module's buffers - the CompVis
checkpoints' `betas`, `alphas_cumprod`, ... - so that they keep their checkpoint names and move
with the module: the objective makes them (`schedule_buffers`) and is handed them back at each
call (`schedule`, a mapping name -> tensor).
"""

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from ldm import flow, sampling, vlb
from ldm.config_errors import is_number
from ldm.schedule import schedule_betas, schedule_buffers, snr

Schedule = Mapping[str, torch.Tensor]
ModelFn = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
# The keys of `LatentDiffusion(objective={...})`: what every objective's constructor takes.
SETTINGS = ("schedule", "min_snr_gamma", "offset_noise")


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, 1) to scale a batch shaped like `like`."""
    return values.view(like.shape[0], *([1] * (like.dim() - 1)))


class Objective:
    """The interface. `name` is the config spelling (`parameterization: eps | v | flow`).

    offset_noise: add `offset_noise * N(0, 1)` per sample and channel to the noise, so the model
    can learn very dark or bright images (Guttenberg 2023, "Diffusion with offset noise").
    """

    name: str
    num_timesteps: int  # T: the backbone sees times in [0, T)

    def __init__(self, offset_noise: float = 0.0):
        if not is_number(offset_noise):
            raise ValueError(f"offset_noise={offset_noise!r}: expected a number (0.1 is common)")
        self.offset_noise = offset_noise

    def schedule_buffers(self) -> dict[str, torch.Tensor]:
        """The DDPM schedule buffers the module registers under their CompVis names."""
        return schedule_buffers(self.betas)

    def sample_t(self, n: int, generator=None, device=None, latent_size=None) -> torch.Tensor:
        """(n,) training times in the backbone's units; latent_size: the batch's latent (h, w),
        for a time distribution that depends on the image size (Flux's shift)."""
        raise NotImplementedError

    def draw_noise(self, z: torch.Tensor, generator=None) -> torch.Tensor:
        """Gaussian noise like z, plus the offset noise (one draw per sample and channel)."""
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        if self.offset_noise:
            offset = torch.randn(
                *z.shape[:2], 1, 1, generator=generator, device=z.device, dtype=z.dtype
            )
            noise = noise + self.offset_noise * offset
        return noise

    def noised(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        """x_t: the latents z noised with `noise` at times t."""
        raise NotImplementedError

    def target(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        """What the backbone should output for x_t."""
        raise NotImplementedError

    def weight(self, t, schedule: Schedule) -> torch.Tensor | None:
        """Per-sample loss weights (B,), or None for plain MSE."""
        return None

    def prediction(self, output: torch.Tensor) -> torch.Tensor:
        """The part of the backbone's output that the target is compared with."""
        return output

    def loss(self, model_fn: ModelFn, z, noise, t, cond, schedule: Schedule) -> torch.Tensor:
        """Per-sample loss (B,) of the backbone `model_fn(x_t, t, cond)` on z noised at t."""
        x_t = self.noised(z, noise, t, schedule)
        return self.prediction_loss(model_fn(x_t, t, cond), z, noise, t, schedule)

    def prediction_loss(self, prediction, z, noise, t, schedule: Schedule) -> torch.Tensor:
        """The (weighted) mean squared error of a prediction, per sample (B,), in float32."""
        target = self.target(z, noise, t, schedule)
        per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none")
        per_sample = per_sample.mean(dim=tuple(range(1, z.dim())))
        weight = self.weight(t, schedule)
        return per_sample if weight is None else per_sample * weight

    def sample(self, model_fn: ModelFn, noise, schedule: Schedule, **options) -> torch.Tensor:
        """Latents x_0 from noise with the backbone `model_fn(x_t, t, cond)`; options are
        `LatentDiffusion.sample`'s (sampler, steps, cond, uncond, scale, eta, karras, generator,
        init_latent, strength)."""
        raise NotImplementedError


def _needs_learned_variance(sampler: str) -> bool:
    return getattr(sampling.SAMPLER_SPECS.get(sampler), "learned_variance", False)


class DDPM(Objective):
    """The Gaussian process x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) e at integer steps t,
    drawn uniformly from 0..T-1 (Ho et al. 2020, Alg. 1). Eps and V differ in the target.

    schedule: arguments of `ldm.schedule.schedule_betas` (timesteps, beta_schedule, linear_start,
        linear_end, cosine_s, zero_terminal_snr).
    min_snr_gamma: weight the loss by min(SNR, gamma) / (what the prediction's MSE is in units
        of the x_0 error); Hang et al. 2023, arXiv:2303.09556, eq. 10; None = plain MSE.
    """

    def __init__(
        self,
        schedule: Mapping | None = None,
        min_snr_gamma: float | None = None,
        offset_noise: float = 0.0,
    ):
        super().__init__(offset_noise)
        if min_snr_gamma is not None and not (is_number(min_snr_gamma) and min_snr_gamma > 0):
            raise ValueError(
                f"min_snr_gamma={min_snr_gamma!r}: expected a number > 0 (5 is the paper's)"
            )
        self.betas = schedule_betas(**(schedule or {}))
        self.num_timesteps = len(self.betas)
        self.min_snr_gamma = min_snr_gamma

    def sample_t(self, n: int, generator=None, device=None, latent_size=None) -> torch.Tensor:
        return torch.randint(0, self.num_timesteps, (n,), generator=generator, device=device)

    @staticmethod
    def coefficients(t, schedule: Schedule, like: torch.Tensor):
        """sqrt(abar_t), sqrt(1 - abar_t) shaped to scale a batch like `like`."""
        a = _per_sample(schedule["sqrt_alphas_cumprod"][t], like)
        s = _per_sample(schedule["sqrt_one_minus_alphas_cumprod"][t], like)
        return a, s

    def noised(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        a, s = self.coefficients(t, schedule, z)
        return a * z + s * noise

    def predicted_x0(self, x_t, prediction, t, schedule: Schedule) -> torch.Tensor:
        """x_0 as the prediction implies it (the target's formula solved for x_0)."""
        raise NotImplementedError

    def snr_weight_denominator(self, ratio: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight(self, t, schedule: Schedule) -> torch.Tensor | None:
        if self.min_snr_gamma is None:
            return None
        ratio = snr(schedule["alphas_cumprod"][t]).float()
        return ratio.clamp(max=self.min_snr_gamma) / self.snr_weight_denominator(ratio)

    def sample(self, model_fn: ModelFn, noise, schedule: Schedule, **options) -> torch.Tensor:
        sampler = options.get("sampler", "ddim")
        if _needs_learned_variance(sampler):
            raise ValueError(f"sampler {sampler!r} needs a model with learn_sigma: true")
        return self.run_sampler(model_fn, noise, schedule, **options)

    def run_sampler(self, model_fn: ModelFn, noise, schedule: Schedule, **options):
        """`ldm.sampling.sample`: the output is read through a denoiser for eps or v."""
        return sampling.sample(
            model_fn, noise, schedule["alphas_cumprod"], parameterization=self.name, **options
        )


class Eps(DDPM):
    """The backbone predicts the noise e (Ho et al. 2020)."""

    name = "eps"

    def target(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        return noise

    def predicted_x0(self, x_t, prediction, t, schedule: Schedule) -> torch.Tensor:
        a, s = self.coefficients(t, schedule, x_t)
        return (x_t - s * prediction) / a

    def snr_weight_denominator(self, ratio: torch.Tensor) -> torch.Tensor:
        # The eps MSE is the x_0 MSE times SNR: min(SNR, gamma) / SNR (Hang et al. eq. 10).
        return ratio.clamp(min=1e-8)


class V(DDPM):
    """The backbone predicts v = sqrt(abar) e - sqrt(1 - abar) x_0 (Salimans & Ho 2022)."""

    name = "v"

    def target(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        a, s = self.coefficients(t, schedule, z)
        return a * noise - s * z

    def predicted_x0(self, x_t, prediction, t, schedule: Schedule) -> torch.Tensor:
        # x_t = a x_0 + s e and v = a e - s x_0 with a^2 + s^2 = 1  =>  x_0 = a x_t - s v.
        a, s = self.coefficients(t, schedule, x_t)
        return a * x_t - s * prediction

    def snr_weight_denominator(self, ratio: torch.Tensor) -> torch.Tensor:
        # The v MSE is the x_0 MSE times (SNR + 1): min(SNR, gamma) / (SNR + 1) (Hang et al.).
        return ratio + 1


class LearnedVariance(Objective):
    """An eps or v objective whose backbone also outputs the variance interpolation
    (`learn_sigma`, DiT): output channels are the prediction, then the variance value.

    L_hybrid = L_simple + L_vlb with the mean frozen (Nichol & Dhariwal 2021, sec. 3.1; DiT
    uses lambda = 1). Samplers that use the learned variances ("ddpm_learned") read the whole
    output; the others read the prediction half.
    """

    def __init__(self, mean: DDPM):
        if not isinstance(mean, DDPM):
            raise ValueError(
                f"a learn_sigma backbone (DiT's VLB) cannot train with {mean.name!r}: "
                "use parameterization eps or v, or learn_sigma: false"
            )
        self.mean = mean
        self.name, self.num_timesteps = mean.name, mean.num_timesteps

    def schedule_buffers(self) -> dict[str, torch.Tensor]:
        return self.mean.schedule_buffers()

    def sample_t(self, n: int, generator=None, device=None, latent_size=None) -> torch.Tensor:
        return self.mean.sample_t(n, generator, device, latent_size)

    def draw_noise(self, z, generator=None) -> torch.Tensor:
        return self.mean.draw_noise(z, generator)

    def noised(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        return self.mean.noised(z, noise, t, schedule)

    def target(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        return self.mean.target(z, noise, t, schedule)

    def weight(self, t, schedule: Schedule) -> torch.Tensor | None:
        return self.mean.weight(t, schedule)

    def prediction(self, output: torch.Tensor) -> torch.Tensor:
        return output[:, : output.shape[1] // 2]

    def loss(self, model_fn: ModelFn, z, noise, t, cond, schedule: Schedule) -> torch.Tensor:
        x_t = self.noised(z, noise, t, schedule)
        prediction, variance = model_fn(x_t, t, cond).chunk(2, dim=1)
        per_sample = self.mean.prediction_loss(prediction, z, noise, t, schedule)
        pred_x0 = self.mean.predicted_x0(x_t, prediction.detach(), t, schedule)
        return per_sample + vlb.vlb_bits_per_dim(schedule["betas"], z, x_t, t, pred_x0, variance)

    def sample(self, model_fn: ModelFn, noise, schedule: Schedule, **options) -> torch.Tensor:
        if _needs_learned_variance(options.get("sampler", "ddim")):
            return self.mean.run_sampler(model_fn, noise, schedule, **options)

        def predict(x_t, t, cond):
            return self.prediction(model_fn(x_t, t, cond))

        return self.mean.sample(predict, noise, schedule, **options)


class RectifiedFlow(Objective):
    """The backbone predicts the velocity e - x_0 of x_t = (1 - t) x_0 + t e (`ldm.flow`).

    schedule: how t is drawn and shifted (`ldm.flow.FlowSchedule`: timestep_sampling
        logit_normal | mode | uniform, logit_mean, logit_std, mode_scale, shift; Esser et al.
        2024 sec. 3.1 and 5.3.2; or Flux's shift per batch from the latent size,
        use_dynamic_shifting). The density of t is the loss weighting (sec. 3.1): no
        min-SNR weighting here.
    """

    name = "flow"
    num_timesteps = 1000  # the backbone sees t * 1000, as SD3's

    def __init__(
        self,
        schedule: Mapping | None = None,
        min_snr_gamma: float | None = None,
        offset_noise: float = 0.0,
    ):
        if min_snr_gamma is not None:
            raise ValueError("min_snr_gamma is a DDPM weighting: leave it out with 'flow'")
        super().__init__(offset_noise)
        self.times = flow.FlowSchedule.from_config(schedule)
        # The default DDPM schedule's buffers stay in the module so that checkpoints keep their
        # keys and shapes; the flow reads none of them.
        self.betas = schedule_betas()

    def sample_t(self, n: int, generator=None, device=None, latent_size=None) -> torch.Tensor:
        return self.times.sample_t(n, generator, device, latent_size) * self.num_timesteps

    def noised(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        return flow.noised(z, noise, t / self.num_timesteps)

    def target(self, z, noise, t, schedule: Schedule) -> torch.Tensor:
        return flow.velocity(z, noise)

    def sample(self, model_fn: ModelFn, noise, schedule: Schedule, **options) -> torch.Tensor:
        karras, eta = options.pop("karras", False), options.pop("eta", 0.0)
        if karras or eta:
            raise ValueError(
                "karras and eta are DDPM sampler options: leave them out for a flow model"
            )
        options.pop("generator", None)  # the flow samplers draw nothing
        steps = options.pop("steps", 28)
        return flow.sample(
            model_fn,
            noise,
            steps=steps,
            sigmas=self.times.sigmas(steps, noise.shape[-2:], self.num_timesteps),
            num_train_timesteps=self.num_timesteps,
            **options,
        )


OBJECTIVES: dict[str, type[Objective]] = {"eps": Eps, "v": V, "flow": RectifiedFlow}


def build(parameterization: str = "eps", settings: Mapping | None = None) -> Objective:
    """The objective named by `parameterization` with `settings` (keys: SETTINGS)."""
    if parameterization not in OBJECTIVES:
        raise ValueError(f"parameterization must be 'eps', 'v' or 'flow', got {parameterization!r}")
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"model.params.objective: unknown keys {unknown}; expected {SETTINGS}")
    return OBJECTIVES[parameterization](**settings)


def for_backbone(objective: Objective, backbone) -> Objective:
    """The objective as `backbone` is trained by it: a backbone that also outputs its variance
    (`learn_sigma`, DiT) gets the variational-bound term (`LearnedVariance`)."""
    return LearnedVariance(objective) if getattr(backbone, "learn_sigma", False) else objective
