"""The `lightning:` blocks users bring from the original projects run unchanged (issue 14).

The block below is the translunar-diffusion write-up's, at toy step counts: CompVis'
`main.ImageLogger` with its original parameters, a dict of named loggers with the old
`pytorch_lightning.` paths, a progress bar of the user's, three ModelCheckpoints without a
`dirpath` monitoring the original models' validation key; and `lightning.deepspeed` beside
`trainer.strategy: deepspeed`.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from run_helpers import free_ports, start_main

from lun.run import RunDir
from lun.trainer import build_callbacks, build_logger, trainer_kwargs

WRITE_UP_LIGHTNING = """
lightning:
  trainer:
    max_steps: 4
    val_check_interval: 2
    limit_val_batches: 1
  logger:
    tensorboard:
      target: pytorch_lightning.loggers.tensorboard.TensorBoardLogger
      params:
        flush_secs: 60
        name: tensorboard
  callbacks:
    image_logger:
      target: main.ImageLogger
      params:
        batch_frequency: 2
        max_images: 4
        clamp: true
        increase_log_steps: false
        check_custom_step: true
        log_images_kwargs:
          N: 2
          ddim_steps: 2
          use_ema_scope: false
          inpaint: false
          plot_progressive_rows: false
          plot_diffusion_rows: false
    progress:
      target: lun.callbacks.SmoothedProgressBar
    checkpoint_monitor:
      target: pytorch_lightning.callbacks.ModelCheckpoint
      params:
        monitor: val/loss_simple_ema
        mode: min
        save_top_k: 1
        filename: "monitor/{epoch}-{step}-{val/loss_simple_ema:.3f}"
    checkpoint_periodic:
      target: pytorch_lightning.callbacks.ModelCheckpoint
      params:
        every_n_train_steps: 2
        save_top_k: -1
        filename: "periodic/{epoch}-{step}"
    checkpoint_every_2_steps:
      target: lightning.pytorch.callbacks.ModelCheckpoint
      params:
        every_n_train_steps: 2
        save_top_k: 1
        filename: "every-2-steps"
"""

VALIDATION = """
data:
  params:
    validation:
      target: lun.data.local.Local
      params:
        data_root: {root}
        size: 32
"""

IGNORED = [
    "image_logger.params.clamp",
    "image_logger.params.check_custom_step",
    "image_logger.params.log_images_kwargs.inpaint",
    "image_logger.params.log_images_kwargs.plot_progressive_rows",
    "image_logger.params.log_images_kwargs.plot_diffusion_rows",
]


def write_up_launch(tmp_path: Path, tiny_config: Path, shapes_dir: Path) -> tuple[list, dict]:
    """main.py's arguments and environment for the write-up's block on the tiny config."""
    block = tmp_path / "lightning.yaml"
    block.write_text(WRITE_UP_LIGHTNING + VALIDATION.format(root=shapes_dir))
    args = ["--base", str(tiny_config), str(block)]
    args += [f"data.params.train.params.data_root={shapes_dir}", "-l", str(tmp_path / "logs")]
    return [*args, "-t"], dict(os.environ)


def deepspeed_launch(tmp_path: Path, tiny_config: Path, shapes_dir: Path) -> tuple[list, dict]:
    """main.py's arguments and environment for translunar's `lightning.deepspeed` on 2 CPU
    processes."""
    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={shapes_dir}"]
    args += ["lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2"]
    args += ["lightning.trainer.strategy=deepspeed", "data.params.batch_size=3"]
    args += ["lightning.deepspeed={stage: 1, offload_optimizer: true}"]
    args += ["-l", str(tmp_path / "logs"), "-t"]
    extensions = tmp_path / "torch_extensions"  # where DeepSpeed's JIT builds would go
    return args, {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}


LAUNCHES = {
    "test_write_up_lightning_block_trains_and_writes_where_it_says": write_up_launch,
    "test_deepspeed_stage_1_with_offload_trains_on_two_processes": deepspeed_launch,
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory, tiny_config, shapes_dir):
    """The launch (`LAUNCHES`) of each test of this module that this session runs, started at
    once, each with a rendezvous port of its own: a launch leaves a core idle much of its
    start-up (the DeepSpeed run's rank 1 starts once rank 0 is set up), so they go side by side.
    test name -> (its folder, its process)"""
    wanted = [
        item.originalname
        for item in request.session.items
        if item.module is request.module and item.originalname in LAUNCHES
    ]
    if "test_deepspeed_stage_1_with_offload_trains_on_two_processes" in wanted:
        if importlib.util.find_spec("deepspeed") is None:  # the test skips
            wanted.remove("test_deepspeed_stage_1_with_offload_trains_on_two_processes")
    runs = {}
    for name, port in zip(wanted, free_ports(len(wanted)), strict=True):
        tmp_path = tmp_path_factory.mktemp(name[:40])
        args, env = LAUNCHES[name](tmp_path, tiny_config, shapes_dir)
        runs[name] = (tmp_path, start_main(args, tmp_path, tmp_path / "stderr.txt", port, env))
    yield runs
    for _, process in runs.values():  # a test that failed first leaves no run going
        process.kill()
        process.wait()


def finished(launched: dict, name: str) -> tuple[Path, str]:
    """(the folder, the stderr) of the test `name`'s launch, which must succeed."""
    tmp_path, process = launched[name]
    stderr_file = tmp_path / "stderr.txt"
    assert process.wait(timeout=400) == 0, stderr_file.read_text()[-3000:]
    return tmp_path, stderr_file.read_text()


@pytest.mark.slow
def test_write_up_lightning_block_trains_and_writes_where_it_says(launched):
    tmp_path, stderr = finished(
        launched, "test_write_up_lightning_block_trains_and_writes_where_it_says"
    )
    logs = tmp_path / "logs"

    (run,) = [p for p in logs.iterdir() if p.is_dir()]
    checkpoints = run / "checkpoints"
    # Every user checkpoint is under the run's checkpoints/, none under the logger's folder.
    assert not list((run / "tensorboard").rglob("*.ckpt"))
    (best,) = (checkpoints / "monitor").glob("*.ckpt")
    # `/` in the metric's name: `val_loss_simple_ema=0.123`, not a `val/` folder or 0.000.
    loss = re.fullmatch(r"epoch=0-step=(\d)-val_loss_simple_ema=(\d+\.\d{3})\.ckpt", best.name)
    assert loss is not None, best.name
    assert float(loss.group(2)) > 0
    periodic = sorted(p.name for p in (checkpoints / "periodic").glob("*.ckpt"))
    assert periodic == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert torch.load(checkpoints / "every-2-steps.ckpt", weights_only=False)["global_step"] == 4

    # The image logger sampled at steps 2 and 4 (batch_frequency) with N=2 images, and the
    # grid reached the user's TensorBoard logger.
    grids = sorted((run / "images" / "train").glob("*.png"))
    assert grids and {re.search(r"gs-(\d+)", g.name).group(1) for g in grids} == {
        "000002",
        "000004",
    }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run / "tensorboard").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0})
    accumulator.Reload()
    assert any(tag.startswith("train/") for tag in accumulator.Tags()["images"])

    # One warning line per key without an effect here, naming it; none for the honoured keys.
    for key in IGNORED:
        lines = [line for line in stderr.splitlines() if f"callbacks.{key} " in line]
        assert len(lines) == 1, (key, lines)
    for honoured in ("N", "ddim_steps", "use_ema_scope", "increase_log_steps"):
        assert f".{honoured} is accepted" not in stderr
    assert "multiple progress bar" not in stderr


def test_image_logger_parameters_are_translated(tmp_path, caplog):
    from lun.callbacks import ImageLogger, SmoothedProgressBar

    cfg = {
        "callbacks": {
            "image_logger": {
                "target": "main.ImageLogger",
                "params": {
                    "batch_frequency": 7,
                    "max_images": 8,
                    "clamp": True,
                    "log_images_kwargs": {"N": 3, "ddim_steps": 5, "use_ema_scope": False},
                },
            },
            "progress": {"target": "lun.callbacks.SmoothedProgressBar"},
        }
    }
    callbacks = build_callbacks(cfg, RunDir(tmp_path / "run"), False, False)
    (logger,) = [c for c in callbacks if isinstance(c, ImageLogger)]
    assert (logger.batch_frequency, logger.max_images, logger.steps) == (7, 3, 5)
    assert logger.use_ema is False
    assert len([c for c in callbacks if isinstance(c, SmoothedProgressBar)]) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "lightning.callbacks.image_logger.params.clamp is accepted but has no effect here"
    ]


def test_checkpoint_without_dirpath_writes_into_the_run_and_bad_params_are_config_errors(
    tmp_path,
):
    from lun.config import ConfigError

    run = RunDir(tmp_path / "run")
    cfg = {"callbacks": {"mine": {"target": "pytorch_lightning.callbacks.ModelCheckpoint"}}}
    # Lightning's defaults kept (its file name, metric names inserted, version counter).
    mine = [
        c
        for c in build_callbacks(cfg, run, False, False)
        if getattr(c, "filename", None) == "{epoch}-{step}"
    ]
    assert [c.dirpath for c in mine] == [str(run.checkpoints)]
    assert mine[0].auto_insert_metric_name and mine[0]._enable_version_counter
    cfg["callbacks"]["mine"]["params"] = {"every_n_train_step": 2}
    with pytest.raises(ConfigError, match=r"callbacks\.mine\.params\.every_n_train_step: .*"):
        build_callbacks(cfg, run, False, False)
    with pytest.raises(ConfigError, match=r"lightning\.logger\.tb\.params\.flush_sec: "):
        logger = {"target": "pytorch_lightning.loggers.TensorBoardLogger"}
        build_logger({"logger": {"tb": {**logger, "params": {"flush_sec": 1}}}}, run)
    assert not Path(run.root).exists()  # checked before the run folder


@pytest.mark.parametrize(
    "lightning_cfg",
    [
        {
            "trainer": {"strategy": "deepspeed"},
            "deepspeed": {"stage": 1, "offload_optimizer": True},
        },
        {"deepspeed": {"stage": 1, "offload_optimizer": True}},
    ],
)
def test_deepspeed_section_gives_stage_1_with_optimizer_offload(lightning_cfg):
    pytest.importorskip("deepspeed")
    from lun.strategies import DeepSpeedStrategy

    strategy = trainer_kwargs(
        {**lightning_cfg, "trainer": {"accelerator": "cpu", **lightning_cfg.get("trainer", {})}}
    )["strategy"]
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 1
    assert zero["offload_optimizer"]["device"] == "cpu"


def test_deepspeed_section_with_another_strategy_or_unknown_key_is_a_config_error():
    pytest.importorskip("deepspeed")
    from lun.config import ConfigError

    with pytest.raises(ConfigError, match=r"^lightning\.deepspeed: set for strategy 'ddp'"):
        trainer_kwargs({"trainer": {"strategy": "ddp"}, "deepspeed": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"^lightning\.deepspeed\.stag: .*did you mean 'stage'"):
        trainer_kwargs({"trainer": {"strategy": "deepspeed"}, "deepspeed": {"stag": 1}})


@pytest.mark.slow
def test_deepspeed_stage_1_with_offload_trains_on_two_processes(launched):
    """translunar's way, through the launcher on 2 CPU processes: the engine that trained was
    configured for ZeRO stage 1 with the optimizer offloaded (its config is in the checkpoint),
    with the DataModule's batch size per device (Lightning's "auto" batch size read
    `batch_sampler.batch_size` of lun.data's loader: AttributeError before step 1). The same
    stage as a `lightning.strategy` block: tests/lun/test_strategies.py's presets."""
    pytest.importorskip("deepspeed")
    tmp_path, _ = finished(launched, "test_deepspeed_stage_1_with_offload_trains_on_two_processes")
    logs, extensions = tmp_path / "logs", tmp_path / "torch_extensions"
    # training needs no shared-memory all-reduce op: a minute of g++ not spent
    assert not list(extensions.rglob("deepspeed_shm_comm*"))
    (run,) = logs.iterdir()
    (states,) = (run / "checkpoints").glob("every-2k-steps.ckpt/*/mp_rank_00_model_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)
    zero = saved["ds_config"]["zero_optimization"]
    assert zero["stage"] == 1 and zero["offload_optimizer"]["device"] == "cpu"
    assert saved["ds_config"]["train_micro_batch_size_per_gpu"] == 3  # the DataModule's
    assert saved["global_steps"] == 2
