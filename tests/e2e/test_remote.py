"""Run folders, checkpoints and data on object storage, against a real S3 server on 127.0.0.1.

moto's server mode (the server s3fs's own tests use) is started once for the module on a free
port and stopped at the end; the launcher reaches it as users reach AWS - credentials and the
endpoint from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`).
"""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, load_main, run_main, start_main
from test_resume import AT_EPOCH_END, STEPS, demo_args, training_state

from ldm.util import instantiate_from_config

moto_server = pytest.importorskip(
    "moto.server", reason="needs moto[server] and s3fs (requirements-dev.txt)"
)
pytest.importorskip("s3fs", reason="needs moto[server] and s3fs (requirements-dev.txt)")

SECRET = f"secret-{uuid.uuid4().hex}"  # must never reach a saved config
KEY_ID = f"key-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def s3():
    """(endpoint URL, s3fs filesystem) of a moto S3 server on 127.0.0.1, with one bucket."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = dict(os.environ)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID=KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",  # no instance-role probe: fast, offline
    )
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("lun-test")
    try:
        yield os.environ["AWS_ENDPOINT_URL"], fs
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()


@pytest.fixture
def staging(tmp_path, monkeypatch):
    """This test's staging folder and file cache (a fresh machine's)."""
    monkeypatch.setenv("LUN_STAGING_DIR", str(tmp_path / "staging"))
    monkeypatch.setenv("LUN_FILE_CACHE", str(tmp_path / "file-cache"))
    return tmp_path / "staging"


# --- a run on s3:// -------------------------------------------------------------------------------


def kill_after_first_upload(args: list[str], cwd: Path, env: dict, fs, prefix: str) -> int:
    """Run the launcher, SIGKILL it once a checkpoint's pointer is on the store; its step."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not (pointers := fs.glob(f"{prefix}/*/checkpoints/LATEST")):
            if process.poll() is not None:
                pytest.fail(f"the run ended before its first upload: {process.stderr.read()}")
            assert time.monotonic() < deadline, "no upload after 300 s"
            time.sleep(0.1)
            fs.invalidate_cache()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return json.loads(fs.cat_file(pointers[0]))["step"]


@pytest.mark.slow
def test_a_run_on_s3_is_killed_and_resumes_from_s3_bitwise_exactly(s3, tmp_path, shapes_dir):
    _, fs = s3
    # The straight run (local) goes on beside the interrupted one: a launch leaves a core idle
    # much of its start-up.
    straight_args = demo_args(shapes_dir, tmp_path / "straight", AT_EPOCH_END)
    straight = start_main(straight_args, tmp_path, tmp_path / "straight.err")

    # The interrupted run reads its data from s3:// and writes its folder there (with TensorBoard
    # on), staged on one machine ...
    fs.put(str(shapes_dir), "lun-test/e2e/shapes", recursive=True)
    args = demo_args(shapes_dir, tmp_path / "unused", AT_EPOCH_END)
    args[args.index(f"data.params.train.params.data_root={shapes_dir}")] = (
        "data.params.train.params.data_root=s3://lun-test/e2e/shapes"
    )
    args[args.index("-l") + 1] = "s3://lun-test/runs"
    args[args.index("lightning.logger=false")] = "lightning.logger=null"
    env = {**os.environ, "LUN_STAGING_DIR": str(tmp_path / "machine-1")}
    env["LUN_FILE_CACHE"] = str(tmp_path / "machine-1-files")
    try:
        stopped_at = kill_after_first_upload(args, tmp_path, env, fs, "lun-test/runs")
    finally:
        straight.wait(timeout=600)
    assert straight.returncode == 0, (tmp_path / "straight.err").read_text()[-3000:]
    (straight_run,) = (tmp_path / "straight").iterdir()
    assert 0 < stopped_at < STEPS and stopped_at % AT_EPOCH_END == 0
    (run,) = fs.ls("lun-test/runs", refresh=True)

    # ... and resumes on another, which has only the URL.
    env["LUN_STAGING_DIR"] = str(tmp_path / "machine-2")
    env["LUN_FILE_CACHE"] = str(tmp_path / "machine-2-files")
    resumed = run_main(["--resume", f"s3://{run}", "-t"], cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "random-number streams restored" in resumed.stderr
    assert (tmp_path / "machine-2").is_dir() and (tmp_path / "machine-2-files").is_dir()

    fs.invalidate_cache()  # this process's listings are from before the resume
    pointer = json.loads(fs.cat_file(f"{run}/checkpoints/LATEST"))
    assert pointer["step"] == STEPS
    downloaded = tmp_path / "final.ckpt"
    fs.get_file(f"{run}/{pointer['checkpoint']}", str(downloaded))
    expected = training_state(straight_run / "checkpoints" / "last.ckpt")
    got = training_state(downloaded)
    assert got.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. {differ[:3]}"

    # Configs and TensorBoard events went up too; no credential is in a saved config.
    configs = fs.glob(f"{run}/configs/*.yaml")
    assert len(configs) == 4  # the first start's pair and the resume's
    for config in configs:
        text = fs.cat_file(config).decode()
        assert SECRET not in text and KEY_ID not in text
    assert fs.glob(f"{run}/tensorboard/events.out.tfevents.*")
    # Only the pointer's version of the overwritten checkpoint is left on the store.
    assert len(fs.glob(f"{run}/checkpoints/every-{AT_EPOCH_END}-steps-*.ckpt")) == 1


def save_checkpoint(path: Path, step: int, size: int = 50_000) -> None:
    weights = torch.randn(size, generator=torch.Generator().manual_seed(step))
    torch.save({"global_step": step, "optimizer_states": [{}], "state_dict": {"w": weights}}, path)


def test_a_killed_upload_never_leaves_the_pointer_naming_an_incomplete_checkpoint(
    s3, tmp_path, staging, monkeypatch
):
    from lun.remote import RemoteRun, sha256_of
    from lun.storage import StorageError

    remote = RemoteRun("s3://lun-test/killed/run")
    remote.run_dir.checkpoints.mkdir(parents=True)
    local = remote.run_dir.checkpoints / "every-2-steps.ckpt"
    save_checkpoint(local, step=2)
    first = sha256_of(local)
    remote.upload_checkpoint(local)
    assert remote.pointer()["sha256"] == first and remote.pointer()["step"] == 2

    save_checkpoint(local, step=4)  # the same name, overwritten by the next save
    put_file = remote.fs.put_file

    def killed_half_way(lpath, rpath, **kwargs):
        remote.fs.pipe_file(rpath, Path(lpath).read_bytes()[:1000])  # what a store may keep
        raise KeyboardInterrupt  # the process dies between the object and the pointer

    monkeypatch.setattr(remote.fs, "put_file", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        remote.upload_checkpoint(local)
    assert remote.pointer()["sha256"] == first

    def truncated_silently(lpath, rpath, **kwargs):
        remote.fs.pipe_file(rpath, Path(lpath).read_bytes()[:1000])

    monkeypatch.setattr(remote.fs, "put_file", truncated_silently)
    remote.upload_checkpoint(local)  # the size check refuses it: logged, retried later
    assert remote.pointer()["sha256"] == first

    # Another machine resumes from what the pointer names: the whole step-2 file.
    monkeypatch.setenv("LUN_STAGING_DIR", str(tmp_path / "elsewhere"))
    remote.fs.pipe_file(f"{remote.path}/configs/a-project.yaml", b"model: {}\n")
    fetched = RemoteRun("s3://lun-test/killed/run").fetch_resume()
    assert sha256_of(fetched) == first and str(tmp_path / "elsewhere") in str(fetched)

    monkeypatch.setattr(remote.fs, "put_file", put_file)
    remote.upload_checkpoint(local)  # retried once the store works again
    assert remote.pointer()["step"] == 4 and remote.pointer()["sha256"] == sha256_of(local)
    assert len(remote.fs.glob(f"{remote.path}/checkpoints/every-2-steps-*.ckpt")) == 1

    # A download is checked against the pointer's size and sha256: a damaged object is refused.
    named = f"{remote.path}/{remote.pointer()['checkpoint']}"
    damaged = bytearray(remote.fs.cat_file(named))
    damaged[-100] ^= 0xFF
    remote.fs.pipe_file(named, bytes(damaged))
    monkeypatch.setenv("LUN_STAGING_DIR", str(tmp_path / "third"))
    with pytest.raises(StorageError, match="does not match the size and sha256"):
        RemoteRun("s3://lun-test/killed/run").fetch_resume()
    assert not list((tmp_path / "third").rglob("*.ckpt"))


# --- errors: one line, exit 2, nothing created ----------------------------------------------------


def launch(argv, capsys) -> tuple[int, str]:
    status = load_main().main(argv)
    return status, capsys.readouterr().err.strip()


def test_a_missing_bucket_credentials_or_package_stop_before_anything_exists(
    s3, tmp_path, staging, monkeypatch, capsys, tiny_config
):
    import s3fs

    base = ["--base", str(tiny_config), "-t", "-l"]
    status, err = launch([*base, "s3://no-such-bucket/runs"], capsys)
    assert status == 2 and "bucket does not exist" in err and len(err.splitlines()) == 1, err

    status, err = launch([*base, "s3://key:secret@lun-test/runs"], capsys)
    assert status == 2 and "credentials in the URL are refused" in err, err

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()  # an instance keeps the credentials it found
    try:
        status, err = launch([*base, "s3://lun-test/other-runs"], capsys)
        assert status == 2 and "no credentials found (set AWS_ACCESS_KEY_ID" in err, err
        status, err = launch(["--resume", "s3://lun-test/runs/some-run", "-t"], capsys)
        assert status == 2 and "no credentials found" in err, err
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # nor one without them for the next tests

    try:
        import gcsfs  # noqa: F401
    except ImportError:
        status, err = launch([*base, "gs://a-bucket/runs"], capsys)
        assert status == 2 and "needs gcsfs: pip install gcsfs" in err, err
    assert not staging.exists()


# --- data ----------------------------------------------------------------------------------------


def datamodule(train: dict):
    params = {"batch_size": 4, "num_workers": 0, "seed": 5, "train": train}
    module = instantiate_from_config(
        OmegaConf.create({"target": "lun.data.DataModule", "params": params})
    )
    module.setup("fit")
    return module


def batches(train: dict) -> list[dict]:
    return list(datamodule(train).train_dataloader())


def assert_same_batches(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a["image"], b["image"]) and a["caption"] == b["caption"]


def test_data_read_from_s3_gives_the_same_batches_as_the_local_copy(
    s3, tmp_path, shapes_dir, staging, monkeypatch
):
    _, fs = s3
    fs.put(str(shapes_dir), "lun-test/data/shapes", recursive=True)
    local = {"data_root": str(shapes_dir), "size": 16, "flip_p": 0.5}
    on_s3 = {**local, "data_root": "s3://lun-test/data/shapes"}
    expected = batches({"target": "lun.data.local.Local", "params": local})
    # A cache bound below the data set: copies are evicted as reading goes on, batches unchanged.
    monkeypatch.setenv("LUN_FILE_CACHE_GB", "0.000005")  # 5 kB
    monkeypatch.setattr("lun.storage.EVICT_GRACE_S", 0.0)
    got = batches({"target": "lun.data.local.Local", "params": on_s3})
    assert_same_batches(got, expected)
    cached = sum(p.stat().st_size for p in (tmp_path / "file-cache").rglob("*") if p.is_file())
    assert sum(p.stat().st_size for p in shapes_dir.rglob("*") if p.is_file()) > 10_000
    assert 0 < cached <= 5_000

    images = sorted((shapes_dir / "images").glob("*.png"))
    for shard in range(2):
        with tarfile.open(tmp_path / f"{shard}.tar", "w") as tar:
            for path in images[shard::2]:
                tar.add(path, arcname=path.name)
                tar.add(shapes_dir / "captions" / f"{path.stem}.txt", arcname=f"{path.stem}.txt")
        fs.put_file(str(tmp_path / f"{shard}.tar"), f"lun-test/shards/{shard}.tar")
    stream = {"num_examples_to_see": 16, "size": 16, "flip_p": 0.5, "shuffle_buffer": 4}

    def shards(urls):
        return {"target": "lun.data.webdataset.WebDataset", "params": {**stream, "urls": urls}}

    monkeypatch.setenv("LUN_FILE_CACHE_GB", "1")
    expected = batches(shards(str(tmp_path / "{0..1}.tar")))
    assert_same_batches(batches(shards("s3://lun-test/shards/{0..1}.tar")), expected)
