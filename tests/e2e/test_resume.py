"""Resume is exact: N straight steps equal k steps + kill -9 + `--resume` + N - k steps, bit for bit.

Through the launcher, as a user runs it: the demo config (made tiny) with everything that draws
random numbers switched on - caption dropout (`ucg_rate`), flips (`flip_p`), offset noise - and a
warm-up + cosine LR schedule, EMA and AdamW. The interrupted run is killed with SIGKILL (no
exception checkpoint, no clean-up) once it has written a periodic checkpoint. Also: the data's
random draws depend on the batch alone (workers, resume), and a resume with a longer schedule
follows the config.
"""

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, failure_lines, free_ports, run_main, start_main, with_port

import ldm.optim
from ldm.util import instantiate_from_config
from lun.config import check_complete, merge_configs
from lun.generation import find_config

DEMO = ROOT / "configs" / "demo" / "shapes.yaml"
STEPS = 6  # N: past the kill, the resumed runs cross an epoch's end (4 steps; 2 on 2 processes)
# 16 images in batches of 4: 4 steps per epoch on 1 process, 2 on 2. Killed after a checkpoint at
# an epoch's end (the next epoch's loader starts before the streams are restored) or within one.
AT_EPOCH_END, MID_EPOCH = 4, 3


def demo_args(shapes_dir: Path, logs: Path, every: int, *extra: str) -> list[str]:
    """The demo config made tiny, a checkpoint every `every` steps (`extra`: more configs and
    overrides)."""
    return [
        "--base",
        str(DEMO),
        *extra,
        f"data.params.train.params.data_root={shapes_dir}",
        "data.params.batch_size=4",
        "data.params.train.params.flip_p=0.5",
        "model.params.ucg_rate=0.5",
        "model.params.offset_noise=0.1",
        "model.params.unet_config.params.channel_mult=[1,2]",
        "model.params.scheduler_config.params.warmup_steps=2",
        f"lightning.trainer.max_steps={STEPS}",
        f"lightning.callbacks.modelcheckpoint.params.every_n_train_steps={every}",
        "lightning.logger=false",
        "-l",
        str(logs),
        "-t",
    ]


def training_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """UNet weights, EMA shadows and optimizer state of a checkpoint, by name."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = {
        k: v
        for k, v in saved["state_dict"].items()
        if k.startswith(("model.diffusion_model.", "model_ema."))
    }
    for index, moments in saved["optimizer_states"][0]["state"].items():
        for name, value in moments.items():
            state[f"optimizer.{index}.{name}"] = torch.as_tensor(value)
    state["global_step"] = torch.tensor(saved["global_step"])
    return state


def kill_after_first_checkpoint(
    args: list[str], cwd: Path, logs: Path, every: int, port: int | None = None
) -> Path:
    """Run the launcher, SIGKILL its whole process group (every rank) once it has written a
    periodic checkpoint, and return that checkpoint."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=cwd,
        env=with_port(port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the kill reaches DDP's other ranks too
    )
    deadline = time.monotonic() + 300
    try:
        while not (written := list(logs.glob(f"*/checkpoints/every-{every}-steps.ckpt"))):
            if process.poll() is not None:
                pytest.fail(f"the run ended before its first checkpoint: {process.stderr.read()}")
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.01)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return written[0]


def assert_resume_is_exact(
    tmp_path: Path, shapes_dir: Path, every: int, *extra: str, side_by_side: bool = False
) -> Path:
    """Run both ways and compare; returns the resumed run's folder. `side_by_side`: the straight
    run goes on while the interrupted one runs (a launch spends much of its start-up with a core
    idle: DDP's rank 1 is started only once rank 0 is set up), each with a rendezvous port of its
    own (Lightning's pick of a free one could give both the same)."""
    ports = free_ports(2) if side_by_side else [None, None]
    straight_args = demo_args(shapes_dir, tmp_path / "straight", every, *extra)
    straight_err = tmp_path / "straight.err"
    straight = start_main(straight_args, tmp_path, straight_err, ports[0])
    if not side_by_side:
        straight.wait(timeout=600)

    logs = tmp_path / "interrupted"
    args = demo_args(shapes_dir, logs, every, *extra)
    try:
        checkpoint = kill_after_first_checkpoint(args, tmp_path, logs, every, ports[1])
    finally:
        straight.wait(timeout=600)
    assert straight.returncode == 0, straight_err.read_text()[-3000:]
    (straight_run,) = (tmp_path / "straight").iterdir()
    # Resumed from the file itself (written atomically; a kill may fall between `last.ckpt`'s
    # removal and its new link). The step it holds: k, or a later multiple if the kill came late.
    stopped_at = int(training_state(checkpoint)["global_step"])
    assert 0 < stopped_at < STEPS and stopped_at % every == 0
    resumed = run_main(["--resume", str(checkpoint), "-t"], cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, failure_lines(resumed.stderr)
    assert "random-number streams restored" in resumed.stderr

    expected = training_state(straight_run / "checkpoints" / "last.ckpt")
    got = training_state(checkpoint.parent / "last.ckpt")
    assert int(expected["global_step"]) == int(got["global_step"]) == STEPS
    assert got.keys() == expected.keys()
    assert any(k.startswith("model_ema.") for k in got) and any(
        k.startswith("optimizer.") for k in got
    )
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. " + ", ".join(
        f"{k} by {(got[k].double() - expected[k].double()).abs().max():.1e}" for k in differ[:3]
    )
    return checkpoint.parent.parent


def assert_a_longer_resume_follows_the_config(run: Path, cwd: Path) -> None:
    """The README's example: go on to a larger max_steps. The schedule's end moves with it
    (`total_steps: ${lightning.trainer.max_steps}`), said in one line."""
    longer = run_main(
        ["--resume", str(run), f"lightning.trainer.max_steps={STEPS + 3}", "-t"], cwd=cwd
    )
    assert longer.returncode == 0, failure_lines(longer.stderr)
    said = [line for line in longer.stderr.splitlines() if "LR schedule" in line]
    assert len(said) == 1 and f"total_steps {STEPS} -> {STEPS + 3}" in said[0], longer.stderr
    assert f"from step {STEPS}" in said[0]
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == STEPS + 3
    assert saved["lr_schedulers"][0]["lr_lambdas"][0]["total_steps"] == STEPS + 3
    # The saved configs keep the interpolation, and sampling from the run still resolves it.
    model_config = merge_configs(find_config(run / "checkpoints" / "last.ckpt")).model
    check_complete(model_config)
    assert model_config.params.scheduler_config.params.total_steps == STEPS + 3


# The single-process resume (killed at an epoch's end, then a longer resume) runs with LoRA on a
# frozen base: tests/e2e/test_lora_resume.py. Its checks are these plus the adapters'; the full
# weights' exact resume is the 2-process one below (each launch costs start-up, not steps).


@pytest.mark.slow
def test_two_process_ddp_resume_is_bitwise_exact(tmp_path, shapes_dir):
    ddp = ROOT / "configs" / "lightning" / "ddp.yaml"
    on_cpu_with_2 = ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]
    # A loader worker per rank: its flips come from a process whose streams no checkpoint holds.
    worker = "data.params.num_workers=1"
    assert_resume_is_exact(
        tmp_path, shapes_dir, MID_EPOCH, str(ddp), *on_cpu_with_2, worker, side_by_side=True
    )


# --- the parts, without the launcher ---------------------------------------------------------


def scheduler(total_steps: int, lr: float = 0.1):
    """An optimizer and the demo's warm-up + cosine schedule ending at `total_steps`."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    params = {"kind": "cosine", "warmup_steps": 2, "total_steps": total_steps, "min_factor": 0.05}
    config = {"target": "ldm.optim.WarmupScheduler", "params": params}
    return optimizer, ldm.optim.build_scheduler(optimizer, config)["scheduler"]


def learning_rates(optimizer, scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_resumed_schedule_keeps_the_step_and_follows_the_config(monkeypatch):
    said = []
    monkeypatch.setattr(ldm.optim, "rank_zero_info", said.append)
    optimizer, schedule = scheduler(total_steps=6)
    straight = learning_rates(optimizer, schedule, 6)
    saved = optimizer.state_dict(), schedule.state_dict()

    def resumed(total_steps: int, lr: float = 0.1):
        optimizer, schedule = scheduler(total_steps, lr)
        optimizer.load_state_dict(saved[0])
        schedule.load_state_dict(saved[1])
        assert schedule.last_epoch == 6  # the step count is the checkpoint's
        return optimizer, schedule

    same = resumed(6)  # unchanged config: the same rates, bit for bit, and nothing said
    _, reference = scheduler(6)
    assert learning_rates(*same, 3) == [0.1 * reference.lr_lambdas[0](s) for s in range(6, 9)]
    assert same[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.05)  # at the floor: the end
    assert not said

    longer = resumed(12)
    rates = learning_rates(*longer, 6)
    cosine_to_12 = ldm.optim.WarmupScheduler("cosine", 2, 12, 0.05)
    assert rates == [0.1 * cosine_to_12(s) for s in range(6, 12)]
    assert min(rates) > 0.1 * 0.05 and rates[0] < straight[-1] * 10  # above the floor, decaying
    assert said == [
        "LR schedule: the config differs from the checkpoint (total_steps 6 -> 12); "
        "following the config from step 6"
    ]

    said.clear()
    rates = learning_rates(*resumed(12, lr=0.2), 1)  # a new learning rate applies too
    assert rates == [0.2 * cosine_to_12(6)]
    assert "learning rates [0.1] -> [0.2]" in said[0]


def datamodule(shapes_dir: Path, num_workers: int, flip_p: float = 0.5):
    train = {
        "target": "lun.data.local.Local",
        "params": {"data_root": str(shapes_dir), "size": 16, "flip_p": flip_p},
    }
    params = {"batch_size": 4, "num_workers": num_workers, "seed": 5, "train": train}
    config = OmegaConf.create({"target": "lun.data.DataModule", "params": params})
    module = instantiate_from_config(config)
    module.setup("fit")
    return module


def epoch_images(module) -> list[torch.Tensor]:
    return [batch["image"] for batch in module.train_dataloader()]


def test_a_batch_draws_the_same_flips_with_workers_and_after_a_resume(shapes_dir):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    in_process = epoch_images(datamodule(shapes_dir, num_workers=0))
    # Loading moved none of the training process's streams (nor did starting the loader).
    assert torch.equal(torch.get_rng_state(), before)
    unflipped = torch.cat(epoch_images(datamodule(shapes_dir, 0, flip_p=0.0)))  # same order
    flipped = [torch.equal(a, b) for a, b in zip(torch.cat(in_process), unflipped.flip(-1))]
    assert 0 < sum(flipped) < len(flipped)  # some images flipped, some not

    with_workers = epoch_images(datamodule(shapes_dir, num_workers=2))
    assert all(torch.equal(a, b) for a, b in zip(with_workers, in_process, strict=True))

    resumed = datamodule(shapes_dir, num_workers=0)
    resumed.load_state_dict(
        {"train": {"epoch": 0, "position": 2, "world_size": 1, "num_batches": 4, "seed": 5}}
    )
    torch.manual_seed(1)  # the training process's streams play no part
    rest = epoch_images(resumed)
    assert all(torch.equal(a, b) for a, b in zip(rest, in_process[2:], strict=True))


def stream_datamodule(shards: str, num_workers: int):
    train = {
        "target": "lun.data.webdataset.WebDataset",
        "params": {"urls": shards, "num_examples_to_see": 16, "size": 16, "flip_p": 0.5},
    }
    params = {"batch_size": 2, "num_workers": num_workers, "seed": 5, "train": train}
    config = OmegaConf.create({"target": "lun.data.DataModule", "params": params})
    module = instantiate_from_config(config)
    module.setup("fit")
    return module


def test_a_resumed_stream_decodes_the_rest_of_its_epoch_with_the_same_flips(tmp_path, shapes_dir):
    images = sorted((shapes_dir / "images").glob("*.png"))
    for shard in range(2):
        with tarfile.open(tmp_path / f"{shard}.tar", "w") as tar:
            for path in images[shard::2]:
                tar.add(path, arcname=path.name)
    shards = str(tmp_path / "{0..1}.tar")
    full = epoch_images(stream_datamodule(shards, num_workers=2))
    assert len(full) == 8
    resumed = stream_datamodule(shards, num_workers=2)
    resumed.load_state_dict(
        {"train": {"epoch": 0, "position": 3, "world_size": 1, "num_batches": 8, "seed": 5}}
    )
    rest = epoch_images(resumed)
    assert all(torch.equal(a, b) for a, b in zip(rest, full[3:], strict=True))
