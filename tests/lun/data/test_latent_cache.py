"""The latent cache: a cached run trains as an online one, keys follow the content, a crashed
cache run resumes to the same cache, buckets and flips are cached per size and orientation."""

import json
import logging
import shutil

import cache_latents
import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from PIL import Image

from lun.config import merge_configs, to_container
from lun.data import latent_cache_build
from lun.data.datamodule import DataModule
from lun.data.latent_cache import CachedLatents, read_index
from lun.data.local import Local
from lun.trainer import build_model

# (width, height): three aspects -> three buckets of area 32 x 32 at step 16
SIZES = [(48, 32), (32, 48), (32, 32), (48, 32), (32, 48), (32, 32), (48, 24), (24, 48)]
DATA = {"size": 32, "flip_p": 0.5, "buckets": {"area": 1024, "step": 8}, "cache_dir": False}
CACHE_ARGS = ("--text", "--shard-size", "5")


def write_folder(root):
    """8 noise images of three aspects with captions (noise: every pixel matters to the VAE)."""
    (root / "images").mkdir(parents=True)
    (root / "captions").mkdir()
    for i, size in enumerate(SIZES):
        rng = np.random.default_rng(i)
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        (root / "captions" / f"{i}.txt").write_text(f"a picture number {i}")
    return root


@pytest.fixture(scope="module")
def made(tiny_config, tmp_path_factory):
    """(data folder, its cache with text in shards of 5 units), made once for this module."""
    root = write_folder(tmp_path_factory.mktemp("cached") / "data")
    assert make_cache(tiny_config, root, root.parent / "cache", *CACHE_ARGS) == 0
    return root, root.parent / "cache"


@pytest.fixture
def own_copy(made, tmp_path):
    """A copy of `made` that a test may change (mtimes kept: the cache stays valid)."""
    root, cache = made
    shutil.copytree(root, tmp_path / "data")
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "data", tmp_path / "cache"


def train_config(root) -> dict:
    return {"target": "lun.data.local.Local", "params": {"data_root": str(root), **DATA}}


def make_cache(tiny_config, root, out, *extra) -> int:
    """scripts/cache_latents.py, in this process (seed 23, as main.py builds the model)."""
    overrides = [f"data.params.train.params.{k}={json.dumps(v)}" for k, v in DATA.items()]
    return cache_latents.main(
        ["--base", str(tiny_config), f"data.params.train.params.data_root={root}", *overrides]
        + ["--out", str(out), "--batch-size", "3", "--workers", "0", *extra]
    )


def tiny_model(tiny_config, **params):
    dotlist = [f"model.params.{k}={v}" for k, v in params.items()]
    seed_everything(23)
    return build_model(to_container(merge_configs([tiny_config], dotlist))["model"])


def first_steps(model, data: DataModule, steps: int = 2):
    """`steps` SGD steps on the data's first batches; (losses, weights) with seed 0."""
    data.setup("fit")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    torch.manual_seed(0)
    losses, batches = [], iter(data.train_dataloader())
    for _ in range(steps):
        loss = model.diffusion_loss(next(batches))[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.model.state_dict().items()}


def test_a_cached_run_trains_as_the_online_run(tiny_config, made):
    """Same seed, same posterior sampling, same flips and caption dropout: the first steps'
    losses and weights agree, while the cached run never runs the VAE nor (but for the empty
    caption, once) the text encoder."""
    folder, cache = made
    online = tiny_model(tiny_config, ucg_rate=0.5)
    losses, weights = first_steps(online, DataModule(train_config(folder), batch_size=2, seed=3))

    cached = tiny_model(tiny_config, ucg_rate=0.5)
    data = DataModule(train_config(folder), batch_size=2, seed=3, cache=str(cache))
    data.setup("fit")
    data.datasets["train"].check_model(cached)

    def no_vae(x):
        raise AssertionError("the VAE ran on a cached batch")

    cached.first_stage_model.encode = no_vae
    encoder, texts = cached.cond_stage_model, []
    forward = encoder.forward
    encoder.forward = lambda captions: texts.append(list(captions)) or forward(captions)
    cached_losses, cached_weights = first_steps(cached, data)

    torch.testing.assert_close(cached_losses, losses, rtol=1e-5, atol=1e-6)
    for name, value in weights.items():
        torch.testing.assert_close(cached_weights[name], value, rtol=1e-5, atol=1e-6)
    assert texts in ([], [[""]])  # only the empty caption, for dropout


def test_a_changed_image_or_caption_invalidates_exactly_its_entries(tiny_config, own_copy):
    folder, out = own_copy
    CachedLatents(train_config(folder), str(out))  # the copy is valid
    before = read_index(str(out))
    Image.new("RGB", SIZES[2], (9, 99, 199)).save(folder / "images" / "2.png")
    (folder / "captions" / "5.txt").write_text("another caption")
    (folder / "images" / "6.png").touch()  # new mtime, same content: still valid

    with pytest.raises(ValueError, match=r"2 of 8 items .*1 caption changed, 1 image changed"):
        CachedLatents(train_config(folder), str(out))

    model = tiny_model(tiny_config)
    dataset = Local(**train_config(folder)["params"])
    plan = latent_cache_build.make_plan(
        dataset, before["model"], before, True, str(out), shard_size=256
    )
    assert plan.reasons == {"images changed": 1, "captions changed": 1}
    todo = [(u.kind, u.item) for _, units in plan.shards for u in units]
    assert sorted(todo) == [("image", 2), ("text", 5)]

    assert make_cache(tiny_config, folder, out, *CACHE_ARGS) == 0
    after = read_index(str(out))
    changed = {k for k in after["entries"] if k not in before["entries"]}
    assert len(changed) == 3  # the image's two orientations and the caption
    kept = set(after["entries"]) - changed
    assert all(after["entries"][k] == before["entries"][k] for k in kept)
    cached = CachedLatents(train_config(folder), str(out))
    cached.check_model(model)


def test_a_run_from_the_cache_says_so(made, caplog):
    root, cache = made
    with caplog.at_level(logging.INFO, logger="lun.data"):
        CachedLatents(train_config(root), str(cache))
    # 8 images x 2 orientations (flip_p 0.5) + 8 captions
    expected = (
        f"training from latent cache {cache} (24 entries, 8 items, text encoder outputs cached)"
    )
    assert expected in caplog.messages


def test_the_cache_counts_add_up_with_an_unreadable_image(tiny_config, own_copy, caplog, capsys):
    """Planned: 2 images (one now truncated, one changed) and 1 caption; written: 1 image's two
    orientations and the caption, the truncated image left out and counted."""
    folder, out = own_copy
    png = (folder / "images" / "2.png").read_bytes()
    (folder / "images" / "2.png").write_bytes(png[: len(png) // 2])  # header kept: decode fails
    Image.new("RGB", SIZES[3], (9, 99, 199)).save(folder / "images" / "3.png")
    (folder / "captions" / "5.txt").write_text("another caption")
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="lun.data"):
        assert make_cache(tiny_config, folder, out, *CACHE_ARGS) == 0
    # kept: 24 entries less images 2 and 3 (2 latents each) and caption 5's old text = 19
    said = capsys.readouterr().out
    assert "8 items; 19 entries valid, 2 images and 1 captions to encode" in said
    expected = (
        f"cache {out}: encoded 1 of 2 images (1 unreadable, left out) and 1 captions; "
        "index written: 22 entries (19 kept, 3 new) in "
    )
    assert any(m.startswith(expected) for m in caplog.messages), caplog.messages
    assert len(read_index(str(out))["entries"]) == 22


@pytest.mark.slow
def test_a_crashed_cache_run_resumes_to_the_same_cache(tiny_config, made, tmp_path, monkeypatch):
    """An exception after the first shard (the fault a kill leaves: whole shards on disk, no
    index); the rerun keeps that shard and writes what one clean run writes."""
    folder, clean = made
    save, calls = latent_cache_build.save_safetensors, []

    def crash_on_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return save(*args, **kwargs)

    monkeypatch.setattr(latent_cache_build, "save_safetensors", crash_on_second)
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="injected"):
        make_cache(tiny_config, folder, crashed, *CACHE_ARGS)
    assert not (crashed / "index.json").exists()
    first = crashed / calls[0].rsplit("/", 1)[-1]
    written = first.stat().st_mtime_ns
    (crashed / (calls[1].rsplit("/", 1)[-1] + ".tmp")).write_bytes(b"half a shard")  # a kill's
    monkeypatch.setattr(latent_cache_build, "save_safetensors", save)
    assert make_cache(tiny_config, folder, crashed, *CACHE_ARGS) == 0
    assert first.stat().st_mtime_ns == written  # kept, not redone
    clean_files = sorted(p.name for p in clean.iterdir())
    assert len(clean_files) == 5  # 16 units (8 images, 8 captions) in 4 shards of 5, the index
    assert clean_files == sorted(p.name for p in crashed.iterdir())
    for name in clean_files:
        assert (clean / name).read_bytes() == (crashed / name).read_bytes(), name


def test_buckets_and_flips_are_cached_per_size_and_orientation(tiny_config, made):
    folder, out = made
    model = tiny_model(tiny_config)
    cached = CachedLatents(train_config(folder), str(out))
    dataset = cached.dataset
    assert len(set(dataset.batch_groups.tolist())) == 3
    for i in (0, 1, 6):
        keys = cached.keys[i]
        width, height = dataset.item_size(i)
        plain, flipped = cached._tensor(keys["latent"]), cached._tensor(keys["latent_flip"])
        assert plain.shape == (8, height // 2, width // 2)  # mean and logvar of 4 channels
        dataset.flip_p = 0.0
        image = dataset[i]["image"][None]
        dataset.flip_p = 0.5
        with torch.no_grad():
            posterior = model.first_stage_model.encode(image)
            mirrored = model.first_stage_model.encode(image.flip(-1))
        torch.testing.assert_close(plain[:4], posterior.mean[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(flipped[:4], mirrored.mean[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(flipped[4:], mirrored.logvar[0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(plain, flipped)


def test_sampled_latents_are_drawn_once_scaled_and_used_as_they_are(tiny_config, made):
    """`--sample`: one draw of the posterior, seeded by the entry's key (the same on any rank
    and after a resume), times scale_factor; training uses it as it is."""
    folder, out = made
    model = tiny_model(tiny_config)
    cached = CachedLatents(train_config(folder), str(out))
    image = Local(**{**train_config(folder)["params"], "flip_p": 0.0})[2]["image"][None]
    unit = latent_cache_build.Unit("image", 2, ["0123456789abcdef" * 2], (32, 32))
    (latent,) = latent_cache_build.encode_images(model, image, [unit], "sample").values()
    moments = cached._tensor(cached.keys[2]["latent"])  # the posterior entry of the same image
    generator = torch.Generator().manual_seed(int(unit.keys[0][:15], 16))
    noise = torch.randn(4, 16, 16, generator=generator)
    expected = (moments[:4] + torch.exp(0.5 * moments[4:]) * noise) * model.scale_factor
    torch.testing.assert_close(latent, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(model.cached_latent(latent[None]), latent[None])


def test_another_vae_or_a_broken_cache_is_one_line_before_a_run_folder(
    tiny_config, made, tmp_path, capsys, monkeypatch
):
    from run_helpers import load_main

    for name in ("ldm", "lun"):  # the launcher's log handlers (on this test's stderr) go after it
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    main = load_main()
    folder, out = made
    logs = tmp_path / "logs"
    base = ["--base", str(tiny_config), f"data.params.train.params.data_root={folder}"]
    base += [f"data.params.train.params.{k}={json.dumps(v)}" for k, v in DATA.items()]
    cases = {
        str(out): "all 8 items were cached with another first-stage (VAE) weights",
        str(tmp_path / "nowhere"): "does not exist",
        str(folder): "has no index.json",
    }
    for cache, message in cases.items():
        capsys.readouterr()
        # --seed 5: the tiny model's random VAE weights are not those the cache was made with
        args = [*base, f"data.params.cache={cache}", "-l", str(logs), "--seed", "5", "-t"]
        assert main.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("config error: ") and message in err[-1]
        assert "cache_latents.py" in err[-1]
        assert not any("Traceback" in line for line in err)
    assert not logs.exists()


def test_a_dataset_that_cannot_be_cached_is_named_with_what_can(tmp_path):
    """A class folder is map-style too: the refusal says which datasets a cache takes."""
    from lun.data.class_folder import ClassFolder
    from lun.data.latent_cache import check_cacheable

    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "0.png")
    with pytest.raises(ValueError, match=r"^cache: ClassFolder cannot be cached \(only lun.data"):
        check_cacheable(ClassFolder(str(tmp_path), size=8))
