"""instantiate_from_config: a config mistake is a ParamError naming it, a bug inside a
constructor stays a TypeError; the original LatentDiffusion parameters are translated."""

import pytest

from ldm.util import ParamError, TargetError, instantiate_from_config, latent_diffusion_params


class Buggy:
    def __init__(self, size: int = 1):
        len(size)  # a real bug: TypeError raised inside the constructor


def test_unknown_or_missing_parameter_is_a_param_error():
    with pytest.raises(ParamError, match="ldm.conditioning.ClassLabels: .*'num_clases'"):
        instantiate_from_config(
            {"target": "ldm.conditioning.ClassLabels", "params": {"num_clases": 3}}
        )
    with pytest.raises(ParamError, match="num_classes"):
        instantiate_from_config({"target": "ldm.conditioning.ClassLabels"})
    assert issubclass(ParamError, TargetError)  # the launcher reports it as a config error


def test_a_type_error_inside_a_constructor_is_not_a_config_error():
    with pytest.raises(TypeError) as caught:
        instantiate_from_config({"target": f"{__name__}.Buggy", "params": {"size": 3}})
    assert not isinstance(caught.value, TargetError)


def test_original_latent_diffusion_params_are_translated():
    original = {
        "linear_start": 0.001,
        "linear_end": 0.02,
        "timesteps": 500,
        "image_size": 64,
        "channels": 4,
        "monitor": "val/loss_simple_ema",
        "conditioning_key": "crossattn",
        "ucg_rate": 0.1,
        "cond_stage_trainable": True,
        "unet_config": {"target": "U", "params": {"image_size": 32}},
        "cond_stage_config": {"target": "T"},
        "first_stage_config": {"target": "F"},
    }
    assert latent_diffusion_params(original) == {
        "schedule": {"linear_start": 0.001, "linear_end": 0.02, "timesteps": 500},
        "backbone_config": {"target": "U", "params": {"image_size": 64}},
        "conditioner_config": {"target": "T", "params": {"ucg_rate": 0.1, "freeze": False}},
        "first_stage_config": {"target": "F"},
    }
    ours = latent_diffusion_params(original)
    assert latent_diffusion_params(ours) == ours  # our own form passes through
    with pytest.raises(ParamError, match="conditioning_key"):
        latent_diffusion_params({"conditioning_key": "concat"})
    with pytest.raises(ParamError, match="not both"):
        latent_diffusion_params({"unet_config": {}, "backbone_config": {}})
