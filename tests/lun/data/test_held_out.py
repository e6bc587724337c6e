"""A held-out validation split: one metadata folder split by `consider_every_nth` (validation) and
`exclude_every_nth` (training) has no image in both; validation items come the same at every
pass, whatever the batch size, and carry their index (the key of their fixed noise)."""

import json
import logging

import pytest
import torch

from ldm.validation import ITEM_KEY
from lun.data import DataModule
from lun.data.local import Local
from lun.data.metadata import MetadataParams

COUNT = 11


@pytest.fixture
def folder(tmp_path, writers):
    root = tmp_path / "meta"
    for i in range(COUNT):
        writers.save(root / "images" / f"{i:02d}.png", color=writers.noise((16, 16), seed=i))
        meta = {"tags": [f"tag{i}"], "score": i, "path": f"images/{i:02d}.png"}
        (root / "metadata").mkdir(parents=True, exist_ok=True)
        (root / "metadata" / f"{i:02d}.json").write_text(json.dumps(meta))
    return root


def split(root, train_params: dict, flip_p: float = 0.0, batch_size: int = 2) -> DataModule:
    def local(metadata_params):
        params = {"data_root": str(root), "size": 16, "cache_dir": False, "flip_p": flip_p}
        return {"target": "lun.data.local.Local", "params": {**params, **metadata_params}}

    validation = local({"metadata_params": {"consider_every_nth": 4}})
    data = DataModule(
        train=local(train_params),
        validation={**validation, "batch_size": batch_size},
        seed=0,
    )
    data.setup("fit")
    return data


def names(dataset) -> set[str]:
    return {dataset.image_name(i) for i in range(len(dataset))}


def test_exclude_every_nth_holds_out_what_consider_every_nth_takes(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        data = split(folder, {"metadata_params": {"exclude_every_nth": 4}})
    train, held = names(data.datasets["train"]), names(data.datasets["validation"])
    assert held == {"images/00.png", "images/04.png", "images/08.png"}
    assert not train & held
    assert train | held == {f"images/{i:02d}.png" for i in range(COUNT)}
    assert "also training images" not in caplog.text


def test_a_validation_set_inside_the_training_set_is_named(folder, caplog):
    """translunar-diffusion's configs validate on every 8th file and train on all: still runs."""
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        split(folder, {"metadata_params": {}})
    assert "data.params.validation: 3 of its 3 images are also training images" in caplog.text


@pytest.mark.parametrize(
    "stages", [("fit",), ("validate", "fit")], ids=["train-first", "val-first"]
)
def held_out_config(folder) -> dict:
    """The DataModule config of translunar-diffusion's shape: validation is every 4th image of
    the training folder, which trains on all of them."""
    local = {"data_root": str(folder), "size": 16, "cache_dir": False}
    return {
        "train": {"target": "lun.data.local.Local", "params": {**local, "metadata_params": {}}},
        "validation": {
            "target": "lun.data.local.Local",
            "params": {**local, "metadata_params": {"consider_every_nth": 4}},
        },
    }


@pytest.mark.parametrize(
    "stages", [("fit",), ("validate", "fit")], ids=["train-first", "val-first"]
)
def test_the_overlap_is_named_once_whichever_split_is_built_first(folder, caplog, stages):
    """Lightning's `fit` builds train then validation; the launcher (lun.trainer.build_data)
    builds validation first: both name the 3 shared images (0, 4, 8), once."""
    data = DataModule(**held_out_config(folder), seed=0)
    with caplog.at_level(logging.WARNING, logger="lun.data"):
        for stage in stages:
            data.setup(stage)
    assert caplog.text.count("3 of its 3 images are also training images") == 1


def test_the_launcher_names_the_overlap(folder, caplog):
    from lun.trainer import build_data

    with caplog.at_level(logging.WARNING, logger="lun.data"):
        build_data({"target": "lun.data.DataModule", "params": held_out_config(folder)})
    assert "data.params.validation: 3 of its 3 images are also training images" in caplog.text


def test_exclude_every_nth_values_are_checked():
    with pytest.raises(ValueError, match="exclude_every_nth: give it or consider_every_nth"):
        MetadataParams.from_config({"exclude_every_nth": 4, "consider_every_nth": 4})
    with pytest.raises(ValueError, match="exclude_every_nth: expected an integer >= 2"):
        MetadataParams.from_config({"exclude_every_nth": 1})


def test_exclude_every_nth_is_part_of_the_index_cache_key(folder, tmp_path):
    cache = str(tmp_path / "cache")
    full = Local(str(folder), size=16, cache_dir=cache, metadata_params={})
    held_out = Local(
        str(folder), size=16, cache_dir=cache, metadata_params={"exclude_every_nth": 4}
    )
    assert len(full) == COUNT and len(held_out) == COUNT - 3


def validation_items(data: DataModule) -> dict[int, torch.Tensor]:
    """{item index: image} of one validation pass."""
    out = {}
    for batch in data.val_dataloader():
        for index, image in zip(batch[ITEM_KEY].tolist(), batch["image"]):
            out[index] = image
    return out


def test_validation_items_are_the_same_at_every_pass_and_batch_size(folder):
    """Random flips of validation images are seeded by the item, not the batch or the epoch."""
    params = {"metadata_params": {"exclude_every_nth": 4}}
    first = split(folder, params, flip_p=0.5, batch_size=2)
    passes = [validation_items(first), validation_items(first)]  # the second pass: epoch 1
    passes.append(validation_items(split(folder, params, flip_p=0.5, batch_size=3)))
    assert sorted(passes[0]) == [0, 1, 2]
    for other in passes[1:]:
        assert other.keys() == passes[0].keys()
        assert all(torch.equal(other[i], passes[0][i]) for i in other)
    # The flips are drawn: with p = 0.5 over 3 items, a mutation seeding every item alike shows
    # as all flipped or none; these seeds give a mix (checked once, fixed by the item seeds).
    flipped = [not torch.equal(passes[0][i], split_image(folder, i)) for i in sorted(passes[0])]
    assert any(flipped) and not all(flipped)


def split_image(folder, index: int) -> torch.Tensor:
    """Validation item `index` unflipped."""
    dataset = Local(
        str(folder), size=16, cache_dir=False, metadata_params={"consider_every_nth": 4}
    )
    return dataset[index]["image"]
