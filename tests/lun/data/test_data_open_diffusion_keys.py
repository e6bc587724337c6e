"""open-diffusion's dataset keys and CompVis' `wrap` in a lun.data.DataModule config: mapped or
ignored with one notice line each, and the stream then loads what open-diffusion's loader would.

open-diffusion (mlfoundations/open-diffusion, configs/templates/sd_v2_base_stage1.yaml) writes its
WebDataset as `dataset.params: {path, batch_size, workers, num_examples_to_see, resolution,
filters: {punsafe: "<=0.1"}}`, and data/base.py keeps a sample when
`eval(f"{json[key]}{expr}")` holds for every filter."""

import json
import logging

import pytest
from torch.utils.data import DataLoader

from lun.config import ConfigError, merge_configs, to_container
from lun.data import DataModule
from lun.legacy import translate_legacy_keys

OPEN_DIFFUSION_PARAMS = {  # its template's block, the interpolations filled in
    "batch_size": 4,
    "workers": 2,
    "num_examples_to_see": 12,
    "resolution": 16,
    "filters": {"punsafe": "<=0.1"},
}


def open_diffusion_keeps(meta: dict, filters: dict) -> bool:
    """data/base.py's metadata_filters, for the numbers written here."""
    return all(key in meta and eval(f"{meta[key]}{expr}") for key, expr in filters.items())


@pytest.fixture
def shards(tmp_path, writers):
    """2 shards x 6 samples, punsafe (n % 4) / 10 (half over 0.1), sample 5 without json."""
    metas = {}
    for s in range(2):
        samples = []
        for i in range(6):
            n = s * 6 + i
            files = {"png": writers.jpeg_bytes((20, 24), seed=n), "txt": f"c{n:02d}"}
            files["jpg"] = files.pop("png")
            if n != 5:
                metas[f"c{n:02d}"] = {"punsafe": (n % 4) / 10}
                files["json"] = json.dumps(metas[f"c{n:02d}"])
            samples.append((f"{n:05d}", files))
        writers.shard(tmp_path / f"{s:03d}.tar", samples)
    return tmp_path, metas


def config(tmp_path, train_params: dict, target="lun.data.webdataset.WebDataset", **params):
    path = tmp_path / "data.yaml"
    split = {"target": target, "params": train_params}
    data = {"target": "lun.data.DataModule", "params": {"train": split, **params}}
    path.write_text(json.dumps({"data": data}))
    return merge_configs([path])


def test_open_diffusion_webdataset_keys_load_what_its_loader_keeps(shards, caplog):
    folder, metas = shards
    params = {"path": f"{folder}/{{000..001}}.tar", **OPEN_DIFFUSION_PARAMS}
    # seed 0 pinned: which kept samples 3 batches reach depends on the data seed, which would
    # otherwise come from $PL_GLOBAL_SEED (a fixture's seed_everything in the same process)
    cfg = config(folder, params, wrap=False, seed=0)
    with caplog.at_level(logging.WARNING, logger="lun.config"):
        translate_legacy_keys(cfg)
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 2, notices  # one for the split's keys, one for wrap
    assert "data.params.wrap has no effect here" in notices[0]
    assert notices[1].startswith("data.params.train.params: open-diffusion's keys mapped: ")
    data = DataModule(**to_container(cfg)["data"]["params"])
    assert data.batch_size("train") == 4 and data._settings("train")["num_workers"] == 2
    data.setup("fit")
    loader = data.train_dataloader()
    assert isinstance(loader, DataLoader) and loader.num_workers == 2
    batches = list(loader)
    assert len(batches) == 3  # ceil(12 / 4) batches on one rank
    assert all(b["image"].shape == (4, 3, 16, 16) for b in batches)  # resolution -> size
    seen = {c for b in batches for c in b["caption"]}
    kept = {c for c, meta in metas.items() if open_diffusion_keeps(meta, params["filters"])}
    assert seen == kept and len(kept) == 5  # each worker cycles its shard's kept samples


def test_open_diffusion_parquet_and_class_mapping_keys(tmp_path):
    cfg = config(
        tmp_path,
        {"path": "x.parquet", "workers": 1, "batch_size": 2},
        target="lun.data.webdataset.Parquet",
    )
    translate_legacy_keys(cfg)
    train = cfg.data.params.train
    assert train.params == {"paths": "x.parquet"}
    assert (train.num_workers, train.batch_size) == (1, 2)
    cfg = config(tmp_path, {"path": "a.tar", "class_mapping": "idx.json", "resolution": 8})
    translate_legacy_keys(cfg)
    assert cfg.data.params.train.params == {"urls": "a.tar", "idx_to_prompt": "idx.json", "size": 8}


def test_a_key_given_both_ways_is_one_line():
    cfg = merge_configs(
        [],
        [
            "data.target=lun.data.DataModule",
            "data.params.train.target=lun.data.webdataset.WebDataset",
            "data.params.train.params.path=a.tar",
            "data.params.train.params.urls=b.tar",
        ],
    )
    with pytest.raises(ConfigError, match=r"^data\.params\.train\.params\.path .* keep "):
        translate_legacy_keys(cfg)


def test_other_datasets_keep_their_own_keys(tmp_path):
    """`path` and `batch_size` mean nothing special to a dataset that is not a stream."""
    cfg = config(tmp_path, {"path": "a", "batch_size": 3}, target="my.Dataset")
    translate_legacy_keys(cfg)
    assert cfg.data.params.train.params == {"path": "a", "batch_size": 3}
