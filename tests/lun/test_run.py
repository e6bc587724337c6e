"""The run folder: which checkpoint a resume takes, the `last.ckpt` swap, killed writers' leftovers,
SIGUSR1 held during start-up."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lun.atomic_io import atomic_link, atomic_torch_save, remove_stale_temporaries
from lun.callbacks.checkpoints import Checkpoint
from lun.config import ConfigError
from lun.run import (
    checkpoint_step,
    hold_save_signal,
    new_run_dir,
    newest_checkpoint,
    resume_target,
    take_held_save_signal,
)


def save(path: Path, step: int, mtime: float | None = None, **extra) -> Path:
    contents = {"global_step": step, "state_dict": {"w": torch.ones(2)}, "optimizer_states": []}
    atomic_torch_save({**contents, **extra}, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_the_highest_step_wins_over_the_newest_file(tmp_path):
    save(tmp_path / "step-000000004.ckpt", 4, mtime=1000)
    save(tmp_path / "on_exception.ckpt", 8, mtime=2000)
    save(tmp_path / "every-2-steps.ckpt", 6, mtime=3000)  # newer file, older state
    assert newest_checkpoint(tmp_path) == (tmp_path / "on_exception.ckpt", 8)


def test_on_a_tie_the_newest_file_wins(tmp_path):
    save(tmp_path / "a.ckpt", 6, mtime=2000)
    save(tmp_path / "b.ckpt", 6, mtime=1000)
    assert newest_checkpoint(tmp_path) == (tmp_path / "a.ckpt", 6)


def test_incomplete_links_hidden_and_weights_only_files_are_not_taken(tmp_path, caplog):
    save(tmp_path / "kept.ckpt", 2, mtime=1000)
    whole = save(tmp_path / "whole.ckpt", 9).read_bytes()
    (tmp_path / "whole.ckpt").unlink()
    (tmp_path / "truncated.ckpt").write_bytes(whole[: len(whole) - 100])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    atomic_torch_save({"global_step": 9, "state_dict": {}}, tmp_path / "weights-only.ckpt")
    save(tmp_path / ".hidden.ckpt.tmp-1-deadbeef", 9)
    os.rename(tmp_path / ".hidden.ckpt.tmp-1-deadbeef", tmp_path / ".hidden.ckpt")
    os.symlink("truncated.ckpt", tmp_path / "last.ckpt")
    assert newest_checkpoint(tmp_path) == (tmp_path / "kept.ckpt", 2)
    skipped = {r.getMessage().split(": ")[1].removeprefix("skipped ") for r in caplog.records}
    assert skipped == {
        str(tmp_path / n) for n in ("truncated.ckpt", "empty.ckpt", "weights-only.ckpt")
    }


def test_no_complete_checkpoint_is_a_config_error(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 half")
    with pytest.raises(ConfigError, match="no complete checkpoint in"):
        resume_target(str(tmp_path / "run"))


def test_the_folder_of_runs_given_for_a_run_names_one(tmp_path):
    save(tmp_path / "logs" / "2026-01-01T00-00-00_ldm" / "checkpoints" / "last.ckpt", 2)
    with pytest.raises(ConfigError, match="it holds runs: resume one, e.g. .*T00-00-00_ldm$"):
        resume_target(str(tmp_path / "logs"))


def test_a_run_folder_resumes_from_its_newest_checkpoint_and_a_file_from_itself(tmp_path, caplog):
    checkpoints = tmp_path / "run" / "checkpoints"
    save(checkpoints / "every-2-steps.ckpt", 2)
    save(checkpoints / "on_exception.ckpt", 3)
    caplog.set_level("INFO", logger="lun.run")
    run, ckpt = resume_target(str(tmp_path / "run"))
    assert (run.root, ckpt) == (tmp_path / "run", checkpoints / "on_exception.ckpt")
    assert f"resuming from {ckpt} (step 3" in caplog.text
    run, ckpt = resume_target(str(checkpoints / "every-2-steps.ckpt"))  # chosen by hand
    assert (run.root, ckpt) == (tmp_path / "run", checkpoints / "every-2-steps.ckpt")
    assert f"resuming from {ckpt} (step 2)" in caplog.text


def test_a_new_run_folder_is_one_folder_in_a_folder(tmp_path):
    assert new_run_dir(str(tmp_path / "logs"), "ldm").root.parent == tmp_path / "logs"
    (tmp_path / "file").write_text("notes")
    for logdir in (tmp_path / "file", tmp_path / "file" / "logs"):
        with pytest.raises(ConfigError, match=f"-l/--logdir: '{tmp_path / 'file'}' is a file"):
            new_run_dir(str(logdir), "ldm")
    for name, postfix in (("a/b", ""), ("ldm", "/x"), ("..", "/..")):
        with pytest.raises(ConfigError, match="holds a '/'"):
            new_run_dir(str(tmp_path / "logs"), name, postfix)
    assert not (tmp_path / "logs").exists()  # refused before anything is made


def test_a_refused_file_is_not_named_as_resumed(tmp_path, caplog):
    checkpoints = tmp_path / "run" / "checkpoints"
    save(checkpoints / "last.ckpt", 2)

    def refuse(path):
        raise ConfigError(f"{path}: refused")

    caplog.set_level("INFO", logger="lun.run")
    with pytest.raises(ConfigError, match="refused"):
        resume_target(str(tmp_path / "run"), check=refuse)
    assert "resuming from" not in caplog.text  # one line: the refusal


def test_the_step_is_read_without_running_anything_in_the_file(tmp_path):
    sentinel = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    torch.save({"global_step": 5, "optimizer_states": [], "x": Payload()}, tmp_path / "evil.ckpt")
    assert checkpoint_step(tmp_path / "evil.ckpt") == 5
    assert not sentinel.exists()


def test_the_step_of_deepspeed_and_sharded_fsdp_folders(tmp_path):
    deepspeed = tmp_path / "deepspeed.ckpt"
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    torch.save(
        {"module": None, "global_step": 7}, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt"
    )
    fsdp = tmp_path / "fsdp.ckpt"
    fsdp.mkdir()
    torch.save({"global_step": 11}, fsdp / "meta.pt")
    (fsdp / ".metadata").write_bytes(b"")
    assert checkpoint_step(deepspeed) == 7 and checkpoint_step(fsdp) == 11
    assert newest_checkpoint(tmp_path) == (fsdp, 11)


# --- last.ckpt: swapped in one rename ------------------------------------------------------------

GLOBAL_ZERO = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))


def test_last_ckpt_is_relinked_in_one_rename(tmp_path):
    old, new, last = (
        save(tmp_path / "a.ckpt", 2),
        save(tmp_path / "b.ckpt", 4),
        tmp_path / "last.ckpt",
    )
    Checkpoint._link_checkpoint(GLOBAL_ZERO, str(old), str(last))
    Checkpoint._link_checkpoint(GLOBAL_ZERO, str(new), str(last))
    assert os.readlink(last) == "b.ckpt"  # relative: the run folder can move
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "last.ckpt"]


def test_a_death_while_relinking_leaves_the_old_last_ckpt(tmp_path, monkeypatch):
    """Killed right before the new link exists (Lightning removes `last.ckpt` first, then links
    it): `last.ckpt` must still be there, the old one."""
    save(tmp_path / "a.ckpt", 2)
    new, last = save(tmp_path / "b.ckpt", 4), tmp_path / "last.ckpt"
    os.symlink("a.ckpt", last)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "symlink", killed)
    with pytest.raises(KeyboardInterrupt):
        Checkpoint._link_checkpoint(GLOBAL_ZERO, str(new), str(last))
    assert os.readlink(last) == "a.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "last.ckpt"]


def test_without_symlinks_last_ckpt_becomes_a_copy_and_a_folder_is_replaced(tmp_path, monkeypatch):
    new, last = save(tmp_path / "b.ckpt", 4), tmp_path / "last.ckpt"
    (last / "checkpoint").mkdir(parents=True)  # e.g. a DeepSpeed folder written under that name

    def no_links(*args, **kwargs):
        raise OSError("symbolic links need a privilege here")

    monkeypatch.setattr(os, "symlink", no_links)
    atomic_link(new, last)
    assert last.is_file() and not last.is_symlink() and last.read_bytes() == new.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt", "last.ckpt"]


# --- leftovers of killed writers -------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_stale_temporaries_of_ours_are_removed(tmp_path):
    killed = tmp_path / f".x.ckpt.tmp-{dead_pid()}-deadbeef"
    writing = tmp_path / f".x.ckpt.tmp-{os.getpid()}-cafebabe"
    old_folder, new_folder = tmp_path / ".d.ckpt.tmp-0badcafe", tmp_path / ".e.ckpt.tmp-0dd0beef"
    others = [tmp_path / ".x.ckpt.tmp", tmp_path / "x.ckpt.tmp-1-deadbeef", tmp_path / "x.ckpt"]
    for path in (killed, writing, *others):
        path.write_bytes(b"")
    for folder in (old_folder, new_folder):
        folder.mkdir()
        (folder / "shard.pt").write_bytes(b"")
    two_hours_ago = time.time() - 7200
    for path in (old_folder, old_folder / "shard.pt"):
        os.utime(path, (two_hours_ago, two_hours_ago))
    assert remove_stale_temporaries(tmp_path) == [old_folder, killed]
    assert sorted(tmp_path.iterdir()) == sorted([writing, new_folder, *others])


def test_a_save_keeps_a_temporary_another_live_process_writes(tmp_path):
    killed = tmp_path / f".last.ckpt.tmp-{dead_pid()}-deadbeef"
    writing = tmp_path / f".last.ckpt.tmp-{os.getppid()}-cafebabe"
    for path in (killed, writing):
        path.write_bytes(b"half")
    save(tmp_path / "last.ckpt", 1)
    assert sorted(os.listdir(tmp_path)) == sorted(["last.ckpt", writing.name])


# --- SIGUSR1 before fit ------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_is_held_until_taken(monkeypatch):
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        hold_save_signal()
        assert not take_held_save_signal()
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without a handler
        assert take_held_save_signal()
        assert not take_held_save_signal()  # taken once
    finally:
        signal.signal(signal.SIGUSR1, previous)
