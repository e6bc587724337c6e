import logging

import pytest

from lun.config import ConfigError, check_complete, merge_configs, to_container
from lun.legacy import translate_legacy_keys


def write(path, text):
    path.write_text(text)
    return path


def test_merge_left_to_right_then_dotlist_wins(tmp_path):
    a = write(tmp_path / "a.yaml", "model:\n  lr: 1\n  keep: a\ndata:\n  size: 8\n")
    b = write(tmp_path / "b.yaml", "model:\n  lr: 2\ndata:\n  extra: [1, 2]\n")
    cfg = merge_configs([a, b], ["model.lr=3", "data.new.deep=x"])
    assert cfg.model.lr == 3
    assert cfg.model.keep == "a"
    assert cfg.data.size == 8 and list(cfg.data.extra) == [1, 2]
    assert cfg.data.new.deep == "x"
    assert merge_configs([a, b]).model.lr == 2


def test_missing_value_names_its_key(tmp_path):
    a = write(tmp_path / "a.yaml", "data:\n  params:\n    data_root: ???\n")
    cfg = merge_configs([a])
    with pytest.raises(ConfigError, match="data.params.data_root"):
        check_complete(cfg)
    check_complete(merge_configs([a], ["data.params.data_root=/x"]))


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = write(tmp_path / "bad.yaml", "model:\n  a: 1\n  b: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+"):
        merge_configs([bad])


def test_dotlist_without_equals_is_rejected(tmp_path):
    a = write(tmp_path / "a.yaml", "model: {}\n")
    with pytest.raises(ConfigError, match="key.path=value"):
        merge_configs([a], ["model.lr"])


def test_interpolation_and_missing_file(tmp_path):
    a = write(tmp_path / "a.yaml", "size: 4\ndata:\n  size: ${size}\n  bad: ${nope}\n")
    cfg = merge_configs([a])
    assert cfg.data.size == 4
    with pytest.raises(ConfigError, match="nope"):
        check_complete(cfg)
    with pytest.raises(ConfigError, match="not found"):
        merge_configs([tmp_path / "missing.yaml"])


LEGACY = """
model:
  target: ldm.diffusion.LatentDiffusion
  params: {timesteps: 10}
data:
  target: lun.data.DataModule
  params:
    batch_size: 2
    train:
      target: lun.data.local.Local
      params: {data_root: /x, caption_dropout: 0.25}
    validation:
      target: lun.data.local.Local
      params: {data_root: /y}
"""
TRAIN_KEY = "data.params.train.params.caption_dropout"


def _translated(tmp_path, caplog, dotlist=(), text=LEGACY):
    cfg = merge_configs([write(tmp_path / "legacy.yaml", text)], list(dotlist))
    with caplog.at_level(logging.WARNING, logger="lun.config"):
        assert translate_legacy_keys(cfg) is cfg
    check_complete(cfg)
    return to_container(cfg), [r.getMessage() for r in caplog.records]


def test_caption_dropout_moves_to_the_models_ucg_rate_with_one_warning(tmp_path, caplog):
    config, warnings = _translated(tmp_path, caplog)
    assert config["model"]["params"] == {"timesteps": 10, "ucg_rate": 0.25}
    assert "caption_dropout" not in config["data"]["params"]["train"]["params"]
    assert config["data"]["params"]["train"]["params"] == {"data_root": "/x"}
    assert warnings == [
        f"{TRAIN_KEY} is a legacy key: its value 0.25 moved to model.params.ucg_rate"
    ]


def test_caption_dropout_fills_model_params_when_absent_and_follows_interpolation(tmp_path, caplog):
    text = LEGACY.replace("  params: {timesteps: 10}\n", "").replace("0.25", "'${cfg_p}'")
    config, warnings = _translated(tmp_path, caplog, ["cfg_p=1"], text)
    assert config["model"]["params"] == {"ucg_rate": 1.0}
    assert len(warnings) == 1 and TRAIN_KEY in warnings[0]


def test_equal_values_in_both_places_are_accepted(tmp_path, caplog):
    config, warnings = _translated(tmp_path, caplog, ["model.params.ucg_rate=0.25"])
    assert config["model"]["params"]["ucg_rate"] == 0.25
    assert "caption_dropout" not in config["data"]["params"]["train"]["params"]
    assert len(warnings) == 1 and "already had it" in warnings[0]
    # ucg_rate written as an interpolation of the legacy key survives the key's removal
    config, _ = _translated(tmp_path, caplog, [f"model.params.ucg_rate=${{{TRAIN_KEY}}}"])
    assert config["model"]["params"]["ucg_rate"] == 0.25


def test_conflicting_values_name_both_keys(tmp_path, caplog):
    with pytest.raises(ConfigError) as err:
        _translated(tmp_path, caplog, ["model.params.ucg_rate=0.1"])
    message = str(err.value)
    assert TRAIN_KEY in message and "model.params.ucg_rate" in message
    assert "0.25" in message and "0.1" in message and "\n" not in message


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "often", "true"])
def test_invalid_caption_dropout_is_one_line_naming_the_key(tmp_path, caplog, bad):
    with pytest.raises(
        ConfigError, match=rf"^{TRAIN_KEY}=\S+: expected a probability in \[0, 1\]$"
    ):
        _translated(tmp_path, caplog, [f"{TRAIN_KEY}={bad}"])
    key = "data.params.validation.params.caption_dropout"
    with pytest.raises(ConfigError, match=rf"^{key}="):
        _translated(tmp_path, caplog, [f"{key}={bad}"])


def test_other_splits_caption_dropout_is_ignored_with_a_warning(tmp_path, caplog):
    key = "data.params.validation.params.caption_dropout"
    config, warnings = _translated(tmp_path, caplog, [f"{key}=0.5"])
    assert config["model"]["params"]["ucg_rate"] == 0.25  # the train split's value, not 0.5
    assert config["data"]["params"]["validation"]["params"] == {"data_root": "/y"}
    assert f"{key} is ignored: only the train split drops captions" in warnings
    assert len(warnings) == 2


def test_configs_without_the_legacy_key_are_unchanged(tmp_path, caplog):
    text = LEGACY.replace(", caption_dropout: 0.25", "")
    before = to_container(merge_configs([write(tmp_path / "plain.yaml", text)]))
    config, warnings = _translated(tmp_path, caplog, text=text)
    assert config == before and warnings == []
    assert "ucg_rate" not in config["model"]["params"]
    translate_legacy_keys(merge_configs([write(tmp_path / "empty.yaml", "")]))  # no sections
