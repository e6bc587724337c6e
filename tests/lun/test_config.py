import pytest

from lun.config import ConfigError, check_complete, merge_configs


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
