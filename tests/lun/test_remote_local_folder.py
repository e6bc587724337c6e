"""`-l file:///a/folder`: a run mirrored to a local (or mounted network) folder, the one store that
has sub-folders to make. Each upload used to fail ("No such file or directory", retried later)
and the folder stayed empty. (Object stores: tests/e2e/test_remote.py.)"""

import json

import torch

from lun.remote import POINTER, RemoteRun


def test_a_run_mirrored_to_a_file_url_lands_there_with_its_pointer(tmp_path, monkeypatch):
    monkeypatch.setenv("LUN_STAGING_DIR", str(tmp_path / "staging"))
    (tmp_path / "store").mkdir()
    remote = RemoteRun(f"file://{tmp_path}/store/runs/first")
    remote.run_dir.create()
    (remote.run_dir.root / "configs").mkdir(exist_ok=True)
    (remote.run_dir.root / "configs" / "project.yaml").write_text("model: {}\n")
    remote.sync()
    ckpt = remote.run_dir.root / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 3, "state_dict": {}, "optimizer_states": [{}]}, ckpt)
    remote.upload_checkpoint(ckpt)

    store = tmp_path / "store" / "runs" / "first"
    assert (store / "configs" / "project.yaml").read_text() == "model: {}\n"
    pointer = json.loads((store / POINTER).read_text())
    assert (
        pointer["step"] == 3 and (store / pointer["checkpoint"]).read_bytes() == ckpt.read_bytes()
    )
