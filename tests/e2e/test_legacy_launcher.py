"""The original launchers' options and keys (CompVis main.py, translunar-diffusion): translated
with one notice line each, or refused with one line naming what to use instead; `~key` and
`_replace_: true` replace where merging would mix."""

import logging

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from run_helpers import ROOT, run_main, run_main_here

from lun.config import ConfigError, merge_configs
from lun.legacy import legacy_resume, set_data_root, translate_legacy_keys

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"


def compvis_config(tmp_path):
    """A v1-finetune-like CompVis training config at the tiny config's sizes."""
    tiny = yaml.safe_load(TINY.read_text())
    model = tiny["model"]
    model["params"].update(
        {
            "first_stage_key": "image",
            "cond_stage_key": "caption",
            "cond_stage_trainable": False,
            "first_stage_trainable": False,
            "monitor": "val/loss_simple_ema",
            "use_ema": False,
        }
    )
    config = {
        "model": model,
        "data": {
            "target": "main.DataModuleFromConfig",
            "params": {
                "batch_size": 2,
                "num_workers": 0,
                "wrap": False,
                "train": {"target": "lun.data.local.Local", "params": {"size": 32}},
            },
        },
        "lightning": {
            "trainer": {
                "gpus": 0,
                "amp_backend": "native",
                "benchmark": True,
                "max_steps": 2,
                "log_every_n_steps": 1,
                "enable_model_summary": False,
                "num_sanity_val_steps": 0,
            }
        },
    }
    path = tmp_path / "v1-finetune-tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def notices(stderr: str, text: str) -> list[str]:
    return [line for line in stderr.splitlines() if text in line]


@pytest.mark.slow
def test_compvis_style_config_trains_with_one_notice_per_legacy_key(tmp_path, shapes_dir):
    config = compvis_config(tmp_path)
    result = run_main(
        ["--base", str(config), "--data_root", str(shapes_dir), "-l", str(tmp_path), "-t"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for text in (
        "data.target main.DataModuleFromConfig is a legacy target: now lun.data.DataModule",
        "data.params.wrap has no effect here",
        "lightning.trainer.gpus=0 is a legacy key: now lightning.trainer.accelerator=cpu",
        "lightning.trainer.amp_backend has no effect here",
        "--data_root ",
    ):
        assert len(notices(result.stderr, text)) == 1, (text, result.stderr[-3000:])
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "checkpoints").is_dir()]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    (project,) = (run / "configs").glob("*-project.yaml")
    saved = OmegaConf.load(project)
    assert saved.data.target == "lun.data.DataModule" and "wrap" not in saved.data.params
    assert saved.data.params.train.params.data_root == str(shapes_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "zero"], "--gpus='zero': expected a GPU count"),
        (["~data.params.nothing"], "~data.params.nothing: no such key"),
        (["data.params.train._replace_=maybe"], "data.params.train._replace_='maybe'"),
    ],
)
def test_bad_legacy_value_is_one_line_exit_2(tmp_path, shapes_dir, args, message):
    fill = [f"data.params.train.params.data_root={shapes_dir}"]
    result = run_main_here(["--base", TINY, *fill, *args, "-l", tmp_path], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpus_option_becomes_accelerator_and_devices(tmp_path, shapes_dir):
    result = run_main_here(
        ["--base", TINY, "--data_root", shapes_dir, "--gpus", "0,", "-l", tmp_path], cwd=tmp_path
    )
    assert result.returncode == 2
    assert len(notices(result.stderr, "--gpus 0, is a legacy option: now")) == 1, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert "lightning.trainer.accelerator='gpu': not available" in error


@pytest.mark.slow
def test_tilde_on_the_command_line_deletes_a_key(tmp_path, shapes_dir):
    extra = tmp_path / "extra.yaml"
    extra.write_text("data:\n  params:\n    train:\n      params:\n        bogus_key: 1\n")
    files = ["--base", str(TINY), str(extra)]
    rest = ["--data_root", str(shapes_dir), "-l", str(tmp_path)]
    refused = run_main_here([*files, *rest], cwd=tmp_path)
    assert refused.returncode == 2 and "bogus_key" in refused.stderr
    # Among --base's files (as `key=value` overrides may be), not read as a file name.
    result = run_main_here([*files, "~data.params.train.params.bogus_key", *rest], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # After the other options too.
    result = run_main_here([*files, *rest, "~data.params.train.params.bogus_key"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def write(path, text):
    path.write_text(text)
    return path


def test_replace_marker_replaces_instead_of_merging(tmp_path):
    a = write(
        tmp_path / "a.yaml",
        "data:\n  params:\n    train:\n      target: old.Dataset\n"
        "      params: {path: /old, resolution: 512, workers: 4}\n",
    )
    b = write(
        tmp_path / "b.yaml",
        "data:\n  params:\n    train:\n      _replace_: true\n"
        "      target: lun.data.local.Local\n      params: {data_root: /new}\n",
    )
    merged = merge_configs([a, b])
    assert OmegaConf.to_container(merged.data.params.train) == {
        "target": "lun.data.local.Local",
        "params": {"data_root": "/new"},
    }
    # Without the marker the keys merge (what it is there to prevent).
    b.write_text(b.read_text().replace("      _replace_: true\n", ""))
    assert merge_configs([a, b]).data.params.train.params.resolution == 512
    # On the command line too.
    merged = merge_configs([a], ["data.params.train._replace_=true", "data.params.train.target=x"])
    assert OmegaConf.to_container(merged.data.params.train) == {"target": "x"}


def test_tilde_deletes_before_the_overrides(tmp_path):
    a = write(
        tmp_path / "a.yaml", "data:\n  params:\n    train: {target: t, params: {x: 1, y: 2}}\n"
    )
    merged = merge_configs([a], ["~data.params.train.params", "data.params.train.params.z=3"])
    assert OmegaConf.to_container(merged.data.params.train) == {"target": "t", "params": {"z": 3}}
    with pytest.raises(ConfigError, match="~data.params.nope: no such key"):
        merge_configs([a], ["~data.params.nope"])


def legacy_cfg(trainer: dict) -> OmegaConf:
    return OmegaConf.create({"model": {}, "data": {}, "lightning": {"trainer": trainer}})


@pytest.mark.parametrize(
    "gpus, accelerator, devices",
    [("0,", "gpu", [0]), ("0,1", "gpu", [0, 1]), (2, "gpu", 2), (-1, "gpu", -1), (0, "cpu", None)],
)
def test_trainer_gpus_becomes_accelerator_and_devices(gpus, accelerator, devices, caplog):
    cfg = translate_legacy_keys(legacy_cfg({"gpus": gpus}))
    trainer = OmegaConf.to_container(cfg.lightning.trainer)
    assert trainer == {"accelerator": accelerator, **({"devices": devices} if devices else {})}
    assert len([r for r in caplog.records if "lightning.trainer.gpus" in r.message]) == 1


def test_old_trainer_keys(caplog):
    caplog.set_level(logging.INFO)
    cfg = legacy_cfg(
        {"accelerator": "ddp", "amp_backend": "native", "resume_from_checkpoint": "x.ckpt"}
    )
    translate_legacy_keys(cfg)
    assert legacy_resume(cfg) == "x.ckpt"
    assert OmegaConf.to_container(cfg.lightning.trainer) == {"strategy": "ddp"}
    messages = [r.message for r in caplog.records]
    for key in ("accelerator=ddp", "amp_backend", "resume_from_checkpoint"):
        assert len([m for m in messages if key in m]) == 1, messages
    with pytest.raises(ConfigError, match="lightning.trainer.gpus=2 and lightning.trainer.acc"):
        translate_legacy_keys(legacy_cfg({"gpus": 2, "accelerator": "cpu"}))


def test_data_root_sets_train_and_validation():
    cfg = OmegaConf.create({"data": {"params": {"train": {"params": {}}, "validation": {}}}})
    set_data_root(cfg, "/d")
    assert cfg.data.params.train.params.data_root == "/d"
    assert cfg.data.params.validation.params.data_root == "/d"
    with pytest.raises(ConfigError, match="--data_root"):
        set_data_root(OmegaConf.create({"data": {}}), "/d")


def test_data_module_from_config_params(caplog):
    cfg = OmegaConf.create(
        {
            "data": {
                "target": "main.DataModuleFromConfig",
                "params": {"batch_size": 3, "num_workers": None, "wrap": True, "train": {}},
            }
        }
    )
    translate_legacy_keys(cfg)
    assert OmegaConf.to_container(cfg.data) == {
        "target": "lun.data.DataModule",
        "params": {"batch_size": 3, "num_workers": 6, "train": {}},  # CompVis: null = 2 x batch
    }
    for key in ("main.DataModuleFromConfig", "num_workers", "wrap"):
        assert len([r for r in caplog.records if key in r.message]) == 1


def test_compvis_modelcheckpoint_section_configures_the_default_checkpoint(caplog, tmp_path):
    """CompVis main.py merges `lightning.modelcheckpoint` into its default ModelCheckpoint."""
    from lun.run import RunDir
    from lun.trainer import build_callbacks

    caplog.set_level(logging.INFO)
    cfg = OmegaConf.create(
        {
            "lightning": {
                "modelcheckpoint": {"params": {"every_n_train_steps": 7, "filename": "old"}},
                "callbacks": {"modelcheckpoint": {"params": {"filename": "every-7"}}},
            }
        }
    )
    translate_legacy_keys(cfg)
    assert "modelcheckpoint" not in cfg.lightning
    assert OmegaConf.to_container(cfg.lightning.callbacks.modelcheckpoint) == {
        "params": {"every_n_train_steps": 7, "filename": "every-7"}  # the callbacks section wins
    }
    assert len([r for r in caplog.records if "lightning.modelcheckpoint" in r.message]) == 1
    callbacks = build_callbacks(
        OmegaConf.to_container(cfg.lightning), RunDir(tmp_path), False, False
    )
    periodic = [c for c in callbacks if getattr(c, "_every_n_train_steps", None) == 7]
    assert len(periodic) == 1 and periodic[0].filename == "every-7"
