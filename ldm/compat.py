"""The original CompVis / Stability-AI (sgm) model configs, translated to ours: the one place
that knows their target paths and parameter names.

`ldm.util.instantiate_from_config` maps an original `target:` through `ORIGINAL_TARGETS` and
its `params:` through `PARAM_TRANSLATIONS`; everything else of the repo sees our names only.
The launcher's side (Lightning 1.x trainer keys, the original main.py's options and data
module) is `lun/legacy.py`.
"""

import logging
from collections.abc import Callable, Mapping

from ldm.config_errors import ParamError

logger = logging.getLogger(__name__)

# The original CompVis / Stability-AI configs name their classes by the original module paths.
# They load unchanged: each original path maps to the class that replaces it here.
ORIGINAL_TARGETS = {
    "ldm.models.diffusion.ddpm.LatentDiffusion": "ldm.diffusion.LatentDiffusion",
    "ldm.modules.diffusionmodules.openaimodel.UNetModel": "ldm.unet.UNetModel",
    # With a training loss the trainable VAE module, with torch.nn.Identity the frozen VAE.
    "ldm.models.autoencoder.AutoencoderKL": "ldm.autoencoder_training.autoencoder_kl",
    "ldm.modules.losses.LPIPSWithDiscriminator": "ldm.vae_loss.LPIPSWithDiscriminator",
    "ldm.modules.losses.contperceptual.LPIPSWithDiscriminator": "ldm.vae_loss.LPIPSWithDiscriminator",
    "ldm.models.autoencoder.IdentityFirstStage": "ldm.autoencoder.IdentityFirstStage",
    "ldm.modules.encoders.modules.FrozenCLIPEmbedder": "ldm.text_encoder.FrozenCLIPEmbedder",
    "ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
    "ldm.lr_scheduler.LambdaLinearScheduler": "ldm.optim.LambdaLinearScheduler",
    # Stability-AI generative-models (sgm): SDXL.
    "sgm.models.diffusion.DiffusionEngine": "ldm.diffusion.LatentDiffusion",
    "sgm.modules.diffusionmodules.openaimodel.UNetModel": "ldm.unet.UNetModel",
    "sgm.modules.GeneralConditioner": "ldm.conditioning_xl.GeneralConditioner",
    "sgm.modules.encoders.modules.GeneralConditioner": "ldm.conditioning_xl.GeneralConditioner",
    "sgm.modules.encoders.modules.FrozenCLIPEmbedder": "ldm.text_encoder.FrozenCLIPEmbedder",
    "sgm.modules.encoders.modules.FrozenOpenCLIPEmbedder2": "ldm.text_encoder_xl.FrozenOpenCLIPEmbedder2",
    "sgm.modules.encoders.modules.ConcatTimestepEmbedderND": "ldm.conditioning_xl.ConcatTimestepEmbedderND",
    "sgm.models.autoencoder.AutoencoderKL": "ldm.autoencoder_training.autoencoder_kl",
    "sgm.models.autoencoder.AutoencoderKLInferenceWrapper": "ldm.autoencoder_training.autoencoder_kl",
    "sgm.lr_scheduler.LambdaLinearScheduler": "ldm.optim.LambdaLinearScheduler",
    # The CompVis launcher's data module (its legacy-only params are translated by lun.config).
    "main.DataModuleFromConfig": "lun.data.DataModule",
}


# --- original configs' parameters -------------------------------------------------------------
# Keys of the original CompVis `LatentDiffusion` params that describe the original code's
# bookkeeping. Accepted so original configs load unchanged; they have no effect here.
LATENT_DIFFUSION_BOOKKEEPING = {
    "num_timesteps_cond",
    "log_every_t",
    "first_stage_key",
    "cond_stage_key",
    "channels",
    "monitor",
    "use_ema",  # read by the launcher (it adds the EMA callback), not by the model
    "cond_stage_forward",
    "scale_by_std",
    "loss_type",
    "ignore_keys",
    "load_only_unet",
}
LATENT_DIFFUSION_RENAMES = {
    "unet_config": "backbone_config",
    "cond_stage_config": "conditioner_config",
    "compile_unet": "compile_backbone",
}
SCHEDULE_KEYS = (
    "timesteps",
    "beta_schedule",
    "linear_start",
    "linear_end",
    "cosine_s",
    "zero_terminal_snr",
)


def latent_diffusion_params(params: Mapping) -> dict:
    """The original `LatentDiffusion` params (CompVis names, flat schedule keys, `ucg_rate` and
    `cond_stage_trainable` beside the model) -> `ldm.diffusion.LatentDiffusion`'s. Params already
    in our form pass through unchanged."""
    params = dict(params)
    if params.pop("conditioning_key", "crossattn") != "crossattn":
        raise ParamError("LatentDiffusion: only conditioning_key: crossattn is supported")
    for key in LATENT_DIFFUSION_BOOKKEEPING:
        params.pop(key, None)
    for old, new in LATENT_DIFFUSION_RENAMES.items():
        if old in params:
            if new in params:
                raise ParamError(f"LatentDiffusion: give {new} or {old}, not both")
            params[new] = params.pop(old)
    schedule = params.pop("schedule", None)
    if schedule is not None and not isinstance(schedule, Mapping):
        raise ParamError(f"schedule: expected a mapping of its settings, got {schedule!r}")
    schedule = dict(schedule or {})
    schedule.update({k: params.pop(k) for k in SCHEDULE_KEYS if k in params})
    if schedule:
        params["schedule"] = schedule
    # The original `image_size` is the latent side the model samples at: the backbone's.
    if "image_size" in params and "backbone_config" in params:
        image_size = params.pop("image_size")
        params["backbone_config"] = _with_params(params["backbone_config"], image_size=image_size)
    # Caption dropout and training of the text encoder belong to the conditioner.
    conditioner = {}
    if "ucg_rate" in params:
        conditioner["ucg_rate"] = params.pop("ucg_rate")
    if "cond_stage_trainable" in params:
        conditioner["freeze"] = not params.pop("cond_stage_trainable")
    # translunar-diffusion's InvokeAI-nyoom defines `first_stage_trainable: true` as "VAE in
    # train mode with requires_grad", but encodes under no_grad, detaches the latent and gives
    # the optimizer only the UNet (and conditioner): its weights never change. Here it is frozen
    # all along - the same weights - and the run says so once.
    if params.pop("first_stage_trainable", False):
        logger.warning(
            "model.params.first_stage_trainable: true - as in translunar-diffusion, the VAE "
            "gets no gradient and is not optimised (its weights stay as loaded); to train the "
            "VAE use configs/autoencoder/ and swap it in with scripts/swap_vae.py"
        )
    first_stage = params.get("first_stage_config")
    if isinstance(first_stage, Mapping):
        params["first_stage_config"] = _frozen_first_stage(first_stage)
    if conditioner and "conditioner_config" in params:
        params["conditioner_config"] = _with_params(params["conditioner_config"], **conditioner)
    return params


def _frozen_first_stage(config: Mapping) -> dict:
    """A first stage's training loss (the original `lossconfig: LPIPSWithDiscriminator`) has no
    use in a diffusion model, whose VAE is frozen: dropped with one warning line."""
    loss = (config.get("params") or {}).get("lossconfig")
    target = loss.get("target") if isinstance(loss, Mapping) else None
    if target in (None, "torch.nn.Identity"):
        return dict(config)
    logger.warning(
        "model.params.first_stage_config.params.lossconfig (%s) has no effect: the diffusion "
        "model's VAE is frozen",
        target,
    )
    return _with_params(config, lossconfig=None)


def _with_params(config: Mapping, **values) -> dict:
    """A copy of a `{target, params}` config with `values` set in its params."""
    return {**config, "params": {**(config.get("params") or {}), **values}}


# --- sgm (generative-models, SDXL) configs' parameters -----------------------------------
# DiffusionEngine params that configure sgm's own training loop and sampler, which the launcher
# and scripts/txt2img.py replace here: accepted with one warning line each.
DIFFUSION_ENGINE_UNUSED = (
    "sampler_config",
    "loss_fn_config",
    "network_wrapper",
    "input_key",
    "log_keys",
    "no_cond_log",
    "en_and_decode_n_samples_a_time",
    "ema_decay_rate",
)
DIFFUSION_ENGINE_RENAMES = {
    "network_config": "backbone_config",
    "compile_model": "compile_backbone",
    "disable_first_stage_autocast": "first_stage_fp32",
}
SGM = "sgm.modules.diffusionmodules."
SCALINGS = {f"{SGM}denoiser_scaling.EpsScaling": "eps", f"{SGM}denoiser_scaling.VScaling": "v"}
LEGACY_DDPM = f"{SGM}discretizer.LegacyDDPMDiscretization"


def diffusion_engine_params(params: Mapping) -> dict:
    """sgm's `DiffusionEngine` params (SDXL) -> `ldm.diffusion.LatentDiffusion`'s: the
    `DiscreteDenoiser` becomes the parameterization and the DDPM schedule, which sgm files do not
    store (`schedule_in_checkpoint: false`)."""
    params = dict(params)
    for key in DIFFUSION_ENGINE_UNUSED:
        if key in params:
            params.pop(key)
            logger.warning(
                "model.params.%s has no effect here (sgm's training loop / sampler; the launcher "
                "and scripts/txt2img.py set these)",
                key,
            )
    params.pop("use_ema", None)  # read by the launcher
    for old, new in DIFFUSION_ENGINE_RENAMES.items():
        if old in params:
            params[new] = params.pop(old)
    # `image_size` (the latent side to sample at) as in CompVis configs; sgm configs have none
    # (then the UNet takes its released layout's: `ldm.unet.UNetModel`).
    backbone = params.get("backbone_config")
    if isinstance(backbone, Mapping):
        backbone_params = backbone.get("params") or {}
        image_size = params.pop("image_size", None)
        if image_size is not None and "image_size" not in backbone_params:
            params["backbone_config"] = _with_params(backbone, image_size=image_size)
    denoiser = params.pop("denoiser_config", None)
    if denoiser is not None:
        params.update(discrete_denoiser(denoiser))
    params["schedule_in_checkpoint"] = False
    first_stage = params.get("first_stage_config")
    if isinstance(first_stage, Mapping):
        params["first_stage_config"] = _frozen_first_stage(first_stage)
    return params


def discrete_denoiser(config: Mapping) -> dict:
    """sgm's `DiscreteDenoiser` (eps or v scaling over the LegacyDDPM discretization) ->
    `{parameterization, schedule}`; any other denoiser is refused by name."""
    key = "model.params.denoiser_config"
    if config.get("target") != f"{SGM}denoiser.DiscreteDenoiser":
        raise ParamError(f"{key}.target: only {SGM}denoiser.DiscreteDenoiser is supported")
    params = dict(config.get("params") or {})
    scaling = (params.pop("scaling_config", None) or {}).get("target")
    if scaling not in SCALINGS:
        raise ParamError(f"{key}.params.scaling_config.target: '{scaling}' not in {list(SCALINGS)}")
    discretization = params.pop("discretization_config", None) or {}
    if discretization.get("target") != LEGACY_DDPM:
        raise ParamError(f"{key}.params.discretization_config.target: expected {LEGACY_DDPM}")
    ddpm = dict(discretization.get("params") or {})
    schedule = {
        "timesteps": params.pop("num_idx", 1000),
        "beta_schedule": "linear",  # sqrt-linspace squared, as LegacyDDPMDiscretization
        "linear_start": ddpm.pop("linear_start", 0.00085),
        "linear_end": ddpm.pop("linear_end", 0.012),
    }
    if ddpm.pop("num_timesteps", schedule["timesteps"]) != schedule["timesteps"]:
        raise ParamError(f"{key}: num_idx and the discretization's num_timesteps differ")
    for name in [*params, *ddpm]:
        logger.warning("%s: '%s' has no effect here", key, name)
    return {"parameterization": SCALINGS[scaling], "schedule": schedule}


def sgm_unet_params(params: Mapping) -> dict:
    """sgm's UNet params: `spatial_transformer_attn_type` names xformers or plain softmax
    attention, both the same maths as `attention_backend` (sdpa by default) runs."""
    params = dict(params)
    kind = params.pop("spatial_transformer_attn_type", "softmax")
    if kind not in ("softmax", "softmax-xformers"):
        raise ParamError(f"spatial_transformer_attn_type: '{kind}' is not softmax[-xformers]")
    if kind == "softmax-xformers" and "attention_backend" not in params:
        logger.warning(
            "network_config.params.spatial_transformer_attn_type: softmax-xformers runs on "
            "attention_backend sdpa (same result); set attention_backend: xformers to use it"
        )
    return params


def sgm_clip_params(params: Mapping) -> dict:
    """sgm's FrozenCLIPEmbedder takes `always_return_pooled`, which SDXL leaves false."""
    params = dict(params)
    if params.pop("always_return_pooled", False):
        raise ParamError("FrozenCLIPEmbedder: always_return_pooled: true is not supported")
    return params


# What the original configs' parameters become, by original (or translated) target.
PARAM_TRANSLATIONS: dict[str, Callable[[Mapping], dict]] = {
    "ldm.diffusion.LatentDiffusion": latent_diffusion_params,
    "sgm.models.diffusion.DiffusionEngine": diffusion_engine_params,
    "sgm.modules.diffusionmodules.openaimodel.UNetModel": sgm_unet_params,
    "sgm.modules.encoders.modules.FrozenCLIPEmbedder": sgm_clip_params,
}
