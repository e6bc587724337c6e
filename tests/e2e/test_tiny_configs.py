"""configs/tiny/: one small config per family, each trained on a plain folder of the user's own
images by `data_root` alone (tests/e2e/test_configs.py trains every one of them), sampled at the size
it trains at, and each shown in docs/tiny-configs.md."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from run_helpers import ROOT

from ldm.util import instantiate_from_config
from lun.config import check_complete, merge_configs, to_container

TINY = sorted((ROOT / "configs" / "tiny").glob("*.yaml"))
DATA_ROOT = "data.params.train.params.data_root=/my/images"


def bases(config: Path) -> list[Path]:
    """An overlay (model settings without a model: lora.yaml) goes after the tiny SD."""
    own = OmegaConf.load(config)
    return (
        [ROOT / "configs" / "tiny" / "ldm.yaml", config] if "target" not in own.model else [config]
    )


def test_there_is_one_per_family():
    assert {p.stem for p in TINY} >= {"ldm", "sdxl", "dit", "vae", "lora"}


@pytest.mark.parametrize("config", TINY, ids=lambda p: p.stem)
def test_data_root_is_all_it_needs_and_the_model_samples_at_the_trained_size(config):
    cfg = merge_configs(bases(config), [DATA_ROOT])
    check_complete(cfg)  # no other `???`
    train = cfg.data.params.train
    assert train.target == "lun.data.local.Local"  # a plain folder, captions optional
    model = instantiate_from_config(to_container(cfg)["model"])
    # txt2img's and the image logger's default size is the model's: the size it trains on
    assert model.default_image_size == train.params.size


@pytest.mark.parametrize("config", TINY, ids=lambda p: p.stem)
def test_the_page_shows_its_one_minute_run(config):
    page = (ROOT / "docs" / "tiny-configs.md").read_text()
    assert f"configs/tiny/{config.name}" in page
