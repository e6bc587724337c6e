"""Every data source trains through `main.py -t` on 1 process, and webdataset also on 2 (gloo on
the CPU): the memory plan's probe measures a real batch of each (streams cannot be indexed: it
takes their first batch), and every rank trains its steps. Each other source's split over 2 ranks
is checked in this process.

The sources are written from the same 16 generated shapes: flat files (Local), one JSON file per
image (metadata mode), class folders (ClassFolder), an instance folder (DreamBooth), two tar
shards (WebDataset, written with open-diffusion's own keys and CompVis' `wrap`), a Parquet file,
and a latent cache made by scripts/cache_latents.py."""

import hashlib
import io
import json
import tarfile
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from run_helpers import ROOT, run_main, run_main_here

from ldm.util import instantiate_from_config

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
DDP = ROOT / "configs" / "lightning" / "ddp.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory, shapes_dir, shape_classes_dir) -> dict[str, dict]:
    """Source name -> the `data` section that trains on it."""
    out = tmp_path_factory.mktemp("sources")
    images = sorted((shapes_dir / "images").glob("*.png"))
    captions = {p.stem: (shapes_dir / "captions" / f"{p.stem}.txt").read_text() for p in images}

    metadata = out / "metadata_mode"
    (metadata / "metadata").mkdir(parents=True)
    (metadata / "images").symlink_to(shapes_dir / "images")
    for image in images:
        tags = {"tags": captions[image.stem].split(), "score": 50, "path": f"images/{image.name}"}
        (metadata / "metadata" / f"{image.stem}.json").write_text(json.dumps(tags))

    shards = out / "shards"
    shards.mkdir()
    for number in range(2):
        with tarfile.open(shards / f"{number:03d}.tar", "w") as tar:
            for image in images[number::2]:
                meta = json.dumps({"punsafe": 0.05 if image.stem != "00003" else 0.9})
                files = {"png": image.read_bytes(), "txt": captions[image.stem], "json": meta}
                for ext, data in files.items():
                    data = data.encode() if isinstance(data, str) else data
                    info = tarfile.TarInfo(f"{image.stem}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "image": [p.read_bytes() for p in images],
            "caption": [captions[p.stem] for p in images],
        }
    )
    pq.write_table(table, out / "shapes.parquet", row_group_size=8)

    import cache_latents

    local = {"data_root": str(shapes_dir), "size": 32, "cache_dir": False}
    cache = out / "cache"
    built = cache_latents.main(
        ["--base", str(TINY), *(f"data.params.train.params.{k}={v}" for k, v in local.items())]
        + ["--out", str(cache), "--workers", "0", "--text"]
    )
    assert built == 0

    def data(train: dict, **params) -> dict:
        return {
            "_replace_": True,
            "target": "lun.data.DataModule",
            "params": {"batch_size": 2, "num_workers": 0, "train": train, **params},
        }

    per_epoch = 2 * 2 * STEPS  # batch 2 x 2 ranks x the steps
    return {
        "local": data({"target": "lun.data.local.Local", "params": local}),
        "metadata": data(
            {
                "target": "lun.data.local.Local",
                "params": {"data_root": str(metadata), "size": 32, "metadata_params": {}},
            }
        ),
        "class_folder": data(
            {
                "target": "lun.data.class_folder.ClassFolder",
                "params": {"data_root": str(shape_classes_dir), "size": 32},
            }
        ),
        "dreambooth": data(
            {
                "target": "lun.data.dreambooth.DreamBooth",
                "params": {
                    "data_root": str(shapes_dir / "images"),
                    "instance_prompt": "a sks shape",
                    "size": 32,
                },
            }
        ),
        # open-diffusion's names (path, resolution, workers, batch_size) and CompVis' wrap
        "webdataset": data(
            {
                "target": "lun.data.webdataset.WebDataset",
                "params": {
                    "path": f"{shards}/{{000..001}}.tar",
                    "resolution": 32,
                    "workers": 2,
                    "batch_size": 2,
                    "num_examples_to_see": per_epoch,
                    "filters": {"punsafe": "<=0.1"},
                },
            },
            wrap=False,
        ),
        "parquet": data(
            {
                "target": "lun.data.webdataset.Parquet",
                "params": {"paths": str(out / "shapes.parquet"), "size": 32},
            }
        ),
        "latent_cache": data({"target": "lun.data.local.Local", "params": local}, cache=str(cache)),
    }


# The map-style sources share one rank split (lun.data.DataModule's BucketBatchSampler), and the
# streams another (lun.data.webdataset.ShardStream, over shards or row groups): each source's split
# is proven in this process below. Under 2 launched processes: webdataset (its notices come from
# each process's own launcher); a map-style source trains on 2 launched processes in
# tests/e2e/test_resume.py (DDP, Local) and tests/e2e/test_lora_strategies.py.
SPLIT = ["local", "metadata", "class_folder", "dreambooth", "latent_cache", "parquet"]
CASES = [(source, 1) for source in [*SPLIT, "webdataset"]] + [("webdataset", 2)]


def _samples(data: dict, rank: int, world_size: int) -> list[str]:
    """A fingerprint of every training sample of one epoch that rank `rank` of `world_size` loads
    (the trainer is a stand-in holding what DataModule reads of one)."""
    datamodule = instantiate_from_config(OmegaConf.create(data))
    datamodule.trainer = SimpleNamespace(
        world_size=world_size,
        global_rank=rank,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
    )
    datamodule.setup("fit")
    samples = []
    for batch in datamodule.train_dataloader():
        tensors = [v for _, v in sorted(batch.items()) if isinstance(v, torch.Tensor)]
        assert tensors, sorted(batch)
        for i in range(len(tensors[0])):
            row = b"".join(t[i].contiguous().numpy().tobytes() for t in tensors)
            samples.append(hashlib.sha1(row).hexdigest())
    return samples


@pytest.mark.parametrize("source", SPLIT)
def test_two_ranks_split_the_one_process_epoch_of_each_source(sources, source):
    """Rank 0 and rank 1 of 2 load the same number of samples (no rank waits for a batch), half
    the one-process epoch each. A map-style source: together exactly the one-process epoch's
    samples (same seed), none twice, none left out. Parquet (a stream: each slot cycles through
    its own shards to its quota): its 2 row groups, one a rank, so no sample on both ranks.
    (webdataset's 2 workers a rank share its 2 shards: tests/lun/data/test_data_webdataset.py
    splits 4 shards over 4 slots.)"""
    data = {k: v for k, v in sources[source].items() if k != "_replace_"}
    one = _samples(data, 0, 1)
    ranks = [_samples(data, rank, 2) for rank in range(2)]
    assert len(one) == 16 or source == "class_folder"  # 16 shapes (36 class images)
    assert len(ranks[0]) == len(ranks[1]) == len(one) // 2
    if source == "parquet":
        assert not set(ranks[0]) & set(ranks[1])
    else:
        assert sorted(ranks[0] + ranks[1]) == sorted(one)


@pytest.mark.slow
@pytest.mark.parametrize(("source", "processes"), CASES)
def test_source_trains_through_the_launcher(tmp_path, sources, source, processes):
    config = tmp_path / f"{source}.yaml"
    config.write_text(yaml.safe_dump({"data": sources[source]}))
    args = ["--base", str(TINY), str(config)]
    if processes == 2:
        args += [str(DDP), "lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]
    args += [f"lightning.trainer.max_steps={STEPS}", "-l", str(tmp_path / "logs"), "-t"]
    if processes == 1:  # the launcher's main() in this process: no second start-up of torch
        result = run_main_here(args, cwd=tmp_path)
    else:  # Lightning starts rank 1 as a copy of this command line: a real launch
        result = run_main(args, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "logs").iterdir()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS
    plan = json.loads((run / "memory-plan.json").read_text())
    (activations,) = [p for p in plan["parts"] if p["name"] == "activations"]
    assert activations["detail"] == "measured by one probe step" and activations["nbytes"] > 0
    if source == "webdataset":
        lines = result.stderr.splitlines()
        notices = [line for line in lines if "open-diffusion" in line]
        assert len(notices) == processes  # one line, from each process's own launcher
        assert "path -> data.params.train.params.urls" in notices[0]
        assert sum("data.params.wrap has no effect" in line for line in lines) == processes
