"""The seed project's `lightning:` blocks and DeepSpeed settings (issue 29 items 1 and 2).

`reference/translunar/` holds translunar-diffusion's own files, unchanged (LunNova/
translunar-diffusion, MIT): `training-lightning.yaml` (f9f0bb6: a progress bar, three
ModelCheckpoints - periodic, per epoch, overwriting - its ImageLogger, a named TensorBoard
logger, `lightning.deepspeed: {stage: 1, offload_optimizer: true}`) and `training-txt2img.yaml`
(06e6206: the same with a monitored checkpoint whose `monitor` is a YAML anchor into `model`).
Only step counts and the CPU's precision are changed here, as overrides.
"""

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from run_helpers import ROOT, free_ports, start_main

from lun.callbacks.checkpoints import Checkpoint
from lun.config import ConfigError, merge_configs, to_container
from lun.legacy import translate_legacy_keys
from lun.run import RunDir
from lun.trainer import build_trainer

SEED = ROOT / "tests" / "reference" / "translunar"
TESTS = os.pathsep.join(
    [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]
)  # callbacks defined here
# What a CPU test changes: step counts, and fp16 (`precision: 16`) which a CPU cannot run.
TOY = ["lightning.trainer.max_steps=4", "lightning.trainer.precision=32"]


def lightning_block(tmp_path: Path, name: str) -> Path:
    """The file's `lightning:` section alone (the txt2img file's `*monitor` anchor resolved by
    YAML itself), as a user splits it from the model they train."""
    block = tmp_path / f"{name}-lightning.yaml"
    OmegaConf.save({"lightning": OmegaConf.load(SEED / name).lightning}, block)
    return block


def trainer_of(tiny_config, block: Path, tmp_path: Path, has_validation: bool, *dotlist: str):
    cfg = to_container(translate_legacy_keys(merge_configs([tiny_config, block], [*TOY, *dotlist])))
    return build_trainer(cfg["lightning"], RunDir(tmp_path / "run"), has_validation)


@pytest.mark.parametrize("name", ["training-lightning.yaml", "training-txt2img.yaml"])
@pytest.mark.parametrize("has_validation", [False, True])
def test_seed_blocks_build_a_trainer_with_every_checkpoint(
    tmp_path, tiny_config, name, has_validation
):
    pytest.importorskip("deepspeed")
    trainer = trainer_of(tiny_config, lightning_block(tmp_path, name), tmp_path, has_validation)
    theirs = OmegaConf.load(SEED / name).lightning.callbacks
    wanted = {c.params.filename for c in theirs.values() if "Checkpoint" in c.target}
    built = {c.filename for c in trainer.callbacks if isinstance(c, Checkpoint)}
    assert wanted and wanted <= built
    keys = [c.state_key for c in trainer.callbacks if isinstance(c, Checkpoint)]
    assert len(keys) == len(set(keys))


TWO_PERIODIC = """
lightning:
  callbacks:
    kept:
      target: pytorch_lightning.callbacks.ModelCheckpoint
      params: {dirpath: CHECKPOINTS/kept, every_n_train_steps: 1, save_top_k: -1}
    overwritten:
      target: lightning.pytorch.callbacks.ModelCheckpoint
      params: {every_n_train_steps: 1, save_top_k: 1}
    ours:
      target: lun.callbacks.checkpoints.Checkpoint
      params: {dirpath: CHECKPOINTS/ours, every_n_train_steps: 1, save_top_k: 1, filename: "{epoch}-{step}"}
"""


def test_checkpoints_that_differ_only_by_folder_or_count_are_told_apart(tmp_path, tiny_config):
    """Lightning's own rule refuses these ("more than one stateful callback"): the same filename
    and interval, another `dirpath` or `save_top_k`."""
    block = tmp_path / "two.yaml"
    block.write_text(TWO_PERIODIC.replace("CHECKPOINTS", str(tmp_path / "run" / "checkpoints")))
    trainer = trainer_of(tiny_config, block, tmp_path, False)
    ours = [
        c for c in trainer.callbacks if isinstance(c, Checkpoint) and c.filename == "{epoch}-{step}"
    ]
    assert len(ours) == 3 and len({c.state_key for c in ours}) == 3
    assert {c.save_top_k for c in ours} == {-1, 1}
    # Two that would write the very same files: one line naming both.
    same = block.read_text().replace(
        "dirpath: " + str(tmp_path / "run" / "checkpoints") + "/ours, ", ""
    )
    block.write_text(same)
    with pytest.raises(
        ConfigError,
        match=r"^lightning\.callbacks\.ours: saves the same files as lightning\.callbacks\.overwritten",
    ):
        trainer_of(tiny_config, block, tmp_path, False)


class Stop(Callback):
    """At the end of step `at_step`: raise (a crash) or send this process SIGINT (Ctrl-C)."""

    def __init__(self, at_step: int, how: str):
        self.at_step, self.how = at_step, how

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.at_step:
            return
        if self.how == "crash":
            raise RuntimeError(f"injected failure at step {trainer.global_step}")
        os.kill(os.getpid(), signal.SIGINT)


def stop_at(step: int, how: str) -> str:
    return f"lightning.callbacks.stop={{target: test_seed_blocks.Stop, params: {{at_step: {step}, how: {how}}}}}"


def saved_step(path: Path) -> int:
    if path.is_dir():  # DeepSpeed writes a folder
        (states,) = path.glob("*/mp_rank_00_model_states.pt")
        return torch.load(states, map_location="cpu", weights_only=False)["global_steps"]
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


STOPPED = [("training-lightning.yaml", "crash"), ("training-txt2img.yaml", "ctrl-c")]
STOPPED_TEST = "test_seed_blocks_train_and_leave_on_exception_after_a_crash_or_ctrl_c"


@pytest.fixture(scope="module")
def stopped_runs(request, tmp_path_factory, tiny_config, shapes_dir):
    """The stopped run of each (block, how) this session's tests ask for, launched at once, each
    with a rendezvous port of its own (DeepSpeed sets up a process group even for one process):
    on 2 cores they run side by side. (block, how) -> (its folder, its process)"""
    pytest.importorskip("deepspeed")
    wanted = [
        (item.callspec.params["name"], item.callspec.params["how"])
        for item in request.session.items
        if item.module is request.module and item.originalname == STOPPED_TEST
    ]
    runs = {}
    for (name, how), port in zip(wanted, free_ports(len(wanted)), strict=True):
        tmp_path = tmp_path_factory.mktemp(how)
        block = lightning_block(tmp_path, name)
        args = [
            "--base",
            str(tiny_config),
            str(block),
            f"data.params.train.params.data_root={shapes_dir}",
        ]
        args += [*TOY, "lightning.callbacks.periodic_checkpoint.params.every_n_train_steps=1"]
        args += [stop_at(2, how), "-l", str(tmp_path / "logs"), "-t"]
        env = {**os.environ, "PYTHONPATH": TESTS}
        process = start_main(args, tmp_path, tmp_path / "stderr.txt", port, env)
        runs[name, how] = (tmp_path, process)
    yield runs
    for _, process in runs.values():  # a test that failed first leaves no run going
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("name, how", STOPPED)
def test_seed_blocks_train_and_leave_on_exception_after_a_crash_or_ctrl_c(stopped_runs, name, how):
    """Verbatim but for the toy step counts, under the block's own DeepSpeed settings (stage 1,
    optimizer offloaded): the user's checkpoints are written where their names say, and a crash
    or Ctrl-C at step 2 leaves `checkpoints/on_exception.ckpt` of step 2."""
    tmp_path, process = stopped_runs[name, how]
    logs = tmp_path / "logs"
    returncode = process.wait(timeout=500)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert returncode == (130 if how == "ctrl-c" else 1), stderr[-3000:]
    assert "more than one stateful callback" not in stderr
    (run,) = logs.iterdir()
    checkpoints = run / "checkpoints"
    assert saved_step(checkpoints / "on_exception.ckpt") == 2
    periodic = sorted(p.name for p in (checkpoints / "periodic").iterdir())
    # Step 2's own save never came: the stop is raised in that step's end, before checkpoints'.
    assert periodic == ["e=0000 gs=000001.ckpt"]
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "name, stage, offload",
    [
        ("deepspeed_stage_1", 1, None),
        ("deepspeed_stage_2_offload", 2, "cpu"),
        ("deepspeed_stage_3_offload", 3, "cpu"),
        ("deepspeed_stage_3_offload_nvme", 3, "nvme"),
    ],
)
def test_every_deepspeed_name_lightning_knows_is_our_adapter(name, stage, offload):
    """The names of Lightning's strategy docs become lun.strategies.DeepSpeedStrategy (CPU too)."""
    pytest.importorskip("deepspeed")
    from lun.strategies import DeepSpeedStrategy, build_strategy

    strategy = build_strategy(name)
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer", {}).get("device") == offload
