"""Backbone and conditioner values that cannot make a model - a word where a number goes, a
zero width or patch, a latent larger than the position table - are one ValueError naming the
parameter, before anything is built, instead of a TypeError or ZeroDivisionError inside the
constructor or a failure at the first training step (all tracebacks)."""

from types import SimpleNamespace

import pytest

from ldm.compat import latent_diffusion_params
from ldm.conditioning_sd3 import SD3Conditioner
from ldm.config_errors import ParamError
from ldm.diffusion import LatentDiffusion
from ldm.flux import Flux
from ldm.mmdit import MMDiT
from ldm.optim import check_optimizer_settings
from ldm.util import instantiate_from_config

MMDIT = {"depth": 2, "hidden_size": 32, "num_heads": 2, "context_dim": 48, "pooled_dim": 40,
         "pos_embed_max_size": 16, "sample_size": 16}  # fmt: skip
FLUX = {"depth": 1, "depth_single_blocks": 1, "hidden_size": 32, "num_heads": 2,
        "axes_dim": [4, 6, 6], "context_dim": 48, "pooled_dim": 16, "sample_size": 16}  # fmt: skip


@pytest.mark.parametrize(
    ("target", "params", "message"),
    [
        ("ldm.mmdit.MMDiT", {**MMDIT, "depth": "abc"}, "^depth='abc': expected a whole number \\(ldm.mmdit.MMDiT\\)"),
        ("ldm.mmdit.MMDiT", {**MMDIT, "hidden_size": 32.5}, "hidden_size=32.5: expected a whole number"),
        ("ldm.flux.Flux", {**FLUX, "num_heads": [2]}, r"^num_heads=\[2\]: expected a whole number \(ldm.flux.Flux\)"),
        ("ldm.flux.Flux", {**FLUX, "guidance_embed": "yes"}, "guidance_embed='yes': expected true or false"),
        ("ldm.conditioning_sd3.SD3Conditioner", {"drop_rate": "abc"}, "drop_rate='abc': expected a number"),
        ("ldm.flux.Flux", {**FLUX, "axes_dim": "abc"}, "^axes_dim='abc': expected a list \\(ldm.flux.Flux\\)"),
        ("ldm.mmdit.MMDiT", {**MMDIT, "dual_attention_layers": 0}, "dual_attention_layers=0: expected a list"),
    ],
)  # fmt: skip
def test_a_word_where_the_signature_wants_a_number_is_a_param_error(target, params, message):
    with pytest.raises(ParamError, match=message):
        instantiate_from_config({"target": target, "params": params})


def test_numbers_in_the_forms_configs_write_them_still_build():
    """An int for a float, None for an optional, a float for a float."""
    params = {**MMDIT, "mlp_ratio": 4, "out_channels": None}
    assert isinstance(
        instantiate_from_config({"target": "ldm.mmdit.MMDiT", "params": params}), MMDiT
    )
    params = {**FLUX, "theta": 10000, "guidance": 3.5}
    assert isinstance(instantiate_from_config({"target": "ldm.flux.Flux", "params": params}), Flux)


@pytest.mark.parametrize(
    ("backbone", "params", "message"),
    [
        (MMDiT, {**MMDIT, "sample_size": 0}, "sample_size=0: expected a whole number >= 1"),
        (MMDiT, {**MMDIT, "patch_size": 0}, "patch_size=0: expected a whole number >= 1"),
        (MMDiT, {**MMDIT, "context_dim": 0}, "context_dim=0: expected a whole number >= 1"),
        (MMDiT, {**MMDIT, "pos_embed_max_size": -1}, "pos_embed_max_size=-1: expected"),
        (Flux, {**FLUX, "num_heads": 0}, "num_heads=0: expected a whole number >= 1"),
        (Flux, {**FLUX, "pooled_dim": 0}, "pooled_dim=0: expected a whole number >= 1"),
        (Flux, {**FLUX, "depth": -1}, "depth=-1: expected a whole number >= 0"),
    ],
)
def test_a_size_below_one_is_named(backbone, params, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        backbone(**params)


def test_sd3_t5_tokens_must_not_be_negative():
    with pytest.raises(ValueError, match="^t5_tokens=-3: expected a whole number >= 0"):
        SD3Conditioner(t5_tokens=-3)


def test_an_image_larger_than_the_position_table_is_refused_by_latent_shape():
    """MMDiT's table reaches pos_embed_max_size * patch_size latent pixels; LatentDiffusion says
    it in image pixels (the rule the launcher and txt2img check sizes by)."""
    assert MMDiT(**{**MMDIT, "pos_embed_max_size": 4}).max_latent_side == 8
    model = SimpleNamespace(
        size_multiple=4,
        downscale=2,
        latent_channels=16,
        backbone=SimpleNamespace(max_latent_side=8),
    )
    assert LatentDiffusion.latent_shape(model, 16, 12) == (16, 8, 6)
    with pytest.raises(ValueError, match="^height and width must be at most 16 for this model"):
        LatentDiffusion.latent_shape(model, 16, 20)
    model.backbone = SimpleNamespace()  # no table (UNet, Flux's RoPE): any multiple fits
    assert LatentDiffusion.latent_shape(model, 400, 20) == (16, 200, 10)


@pytest.mark.parametrize("schedule", [5, "abc", ["shift"]])
def test_a_schedule_that_is_no_mapping_is_named(schedule):
    with pytest.raises(ParamError, match="^schedule: expected a mapping of its settings"):
        latent_diffusion_params({"schedule": schedule, "parameterization": "flow"})


@pytest.mark.parametrize(
    ("optimizer", "scheduler", "message"),
    [
        ({"target": "adamw9"}, None, "optimizer_config.target='adamw9': expected adamw or adamw8bit"),
        ({"params": {"weight_decay": "abc"}}, None, "optimizer_config: weight_decay='abc': expected a number \\(torch.optim.AdamW\\)"),
        ({"params": {"wd": 0.1}}, None, "optimizer_config: torch.optim.AdamW: unknown parameter 'wd'"),
        (None, {"target": "nothing.Here"}, "scheduler_config: target 'nothing.Here': no module"),
        (None, {"target": "ldm.optim.WarmupScheduler", "params": {"kind": "cosin"}}, "scheduler_config: .*kind"),
    ],
)  # fmt: skip
def test_optimizer_and_schedule_are_checked_before_fit(optimizer, scheduler, message):
    """Built only in configure_optimizers (inside fit): checked when the module is built."""
    with pytest.raises(ValueError, match=f"^{message}"):
        check_optimizer_settings(optimizer, scheduler)


def test_an_optimizer_whose_package_is_missing_still_builds_the_model_for_sampling():
    """adamw8bit without bitsandbytes: txt2img, convert and evaluate build the model from the
    run's config and need no optimizer (a training run's plan names the package:
    tests/e2e/test_config_errors.py)."""
    check_optimizer_settings({"target": "nopackage.Adam", "params": {"betas": "any"}}, None)


def test_the_optimizers_the_configs_name_pass():
    for target in ("adamw", "adamw8bit", "torch.optim.SGD"):
        check_optimizer_settings({"target": target, "params": {"weight_decay": 0.01}}, None)
    schedule = {"target": "ldm.optim.WarmupScheduler", "params": {"warmup_steps": 10}}
    check_optimizer_settings(None, schedule)
