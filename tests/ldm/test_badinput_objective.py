"""Bad values of the objective's settings (`parameterization: flow` and its `schedule`, the
DDPM weighting, offset noise) and of the weights files a model config names are one ValueError
naming the key - which the launcher prints as one config-error line - instead of a TypeError
from a constructor or the first training step (a traceback, after the run folder was made)."""

import pytest

from ldm import flow, objectives
from ldm.checkpoint import WrongFileError, check_config_files
from ldm.config_errors import ParamError
from ldm.diffusion import grouped_settings

BAD_SCHEDULES = [
    ({"shift": "abc"}, "schedule.shift must be a number, got 'abc'"),
    ({"shift": None}, "schedule.shift must be a number, got None"),
    ({"logit_std": "abc"}, "schedule.logit_std must be a number"),
    ({"logit_mean": None}, "schedule.logit_mean must be a number, got None"),
    ({"mode_scale": "abc"}, "schedule.mode_scale must be a number"),
    ({"mode_scale": 3.0}, r"schedule.mode_scale must be in \[-1, 1.752\], got 3.0"),
    ({"base_shift": "abc"}, "schedule.base_shift must be a number"),
    ({"max_shift": "abc"}, "schedule.max_shift must be a number"),
    ({"use_dynamic_shifting": "yes"}, "schedule.use_dynamic_shifting must be true or false"),
    ({"shift_sampling": 2}, "schedule.shift_sampling must be true or false, got 2"),
    ({"patch_size": 0}, "schedule.patch_size must be a whole number >= 1, got 0"),
    ({"max_image_seq_len": "abc"}, "schedule.max_image_seq_len must be a whole number >= 1"),
    ({"base_image_seq_len": -5}, "schedule.base_image_seq_len must be a whole number >= 1"),
    ({"shif": 3.0}, "schedule.shif: unknown key; known: timestep_sampling, "),
    ("abc", "schedule: expected a mapping of timestep_sampling, .* got 'abc'"),
    (5, "schedule: expected a mapping of .* got 5"),
]


@pytest.mark.parametrize(
    ("schedule", "message"), BAD_SCHEDULES, ids=[m[:30] for _, m in BAD_SCHEDULES]
)
def test_a_bad_flow_schedule_is_a_value_error_naming_the_key(schedule, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        objectives.build("flow", {"schedule": schedule})


def test_the_flow_schedules_the_configs_use_still_build():
    sd3 = {"timestep_sampling": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0, "shift": 3}
    flux = {"use_dynamic_shifting": True, "base_image_seq_len": 256.0, "shift_sampling": False}
    mode = {"timestep_sampling": "mode", "mode_scale": -1}
    for schedule in (None, {}, sd3, flux, mode):
        assert isinstance(flow.FlowSchedule.from_config(schedule), flow.FlowSchedule)
    assert flow.FlowSchedule.from_config(sd3).shift == 3


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        ("flow", {"offset_noise": "abc"}, "offset_noise='abc': expected a number"),
        ("eps", {"offset_noise": None}, "offset_noise=None: expected a number"),
        ("eps", {"min_snr_gamma": "abc"}, "min_snr_gamma='abc': expected a number > 0"),
        ("v", {"min_snr_gamma": 0}, "min_snr_gamma=0: expected a number > 0"),
    ],
)
def test_a_bad_objective_setting_is_a_value_error_naming_it(name, settings, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        objectives.build(name, settings)


@pytest.mark.parametrize("group", ["objective", "speed"])
@pytest.mark.parametrize("value", ["abc", 5, ["a"]])
def test_a_settings_group_that_is_no_mapping_is_named(group, value):
    groups = {"objective": None, "speed": None, group: value}
    with pytest.raises(ParamError, match=f"^{group}: expected a mapping of its settings"):
        grouped_settings({}, groups["objective"], groups["speed"])


@pytest.mark.parametrize("key", ["ckpt_path", "first_stage_config.params.ckpt_path"])
def test_a_folder_given_as_weights_file_is_named(tmp_path, key):
    """A folder that is no diffusers pipeline: one line, not FileNotFoundError while building."""
    (tmp_path / "images").mkdir()
    params = {"ckpt_path": str(tmp_path / "images")}
    if key != "ckpt_path":
        params = {"first_stage_config": {"params": params}}
    with pytest.raises(
        WrongFileError, match=f"^model.params.{key}: .*images is a folder; expected"
    ):
        check_config_files({"target": "ldm.diffusion.LatentDiffusion", "params": params})


def test_a_diffusers_folder_is_still_a_model(tmp_path):
    # Read as a model folder (its parts' configs named), not refused as "a folder".
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(WrongFileError, match=r"unet/config.json: missing \(is the diffusers"):
        check_config_files(
            {"target": "ldm.diffusion.LatentDiffusion", "params": {"ckpt_path": str(tmp_path)}}
        )
