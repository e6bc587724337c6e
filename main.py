"""Train a latent diffusion model from YAML configs.

python main.py --base configs/a.yaml configs/b.yaml key.path=value -t
python main.py --resume logs/<run> -t         # continue where it stopped
python main.py --base configs/a.yaml             # without -t: build and check, write nothing
"""

import argparse
import copy
import gc
import logging
import pickle
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from lun.cli import seed
from lun.config import ConfigError, check_complete, merge_configs, to_container
from lun.legacy import fold_switch_values, legacy_resume, translate_command_line
from lun.run import RunDir


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-b",
        "--base",
        nargs="*",
        default=[],
        metavar="config.yaml",
        help="YAML configs, merged left to right; `key.path=value` overrides after them win, "
        "`~key.path` deletes a key of the merged files",
    )
    parser.add_argument(
        "-t",
        "--train",
        action="store_true",
        help="train (otherwise only build and check the config; no run folder)",
    )
    parser.add_argument(
        "-n", "--name", default="", help="run name (default: first config's file name)"
    )
    parser.add_argument(
        "-r", "--resume", default="", help="run folder, .ckpt or run URL (s3://...) to resume from"
    )
    parser.add_argument(
        "--unsafe-load",
        action="store_true",
        help="resume from a checkpoint holding pickled code (only one you trust)",
    )
    parser.add_argument("-s", "--seed", type=seed, default=23, help="global seed (default 23)")
    parser.add_argument(
        "-l", "--logdir", default="logs", help="parent folder of run folders, or a URL (s3://...)"
    )
    parser.add_argument("-f", "--postfix", default="", help="appended to the run folder's name")
    parser.add_argument("--no-test", action="store_true", help="skip the test split after training")
    parser.add_argument(
        "--scale_lr",
        action="store_true",
        help="lr = accumulate x devices x nodes x batch size x base_learning_rate",
    )
    parser.add_argument("-d", "--debug", action="store_true", help="full tracebacks, debug logging")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan (one probe step measures activations) and exit; no run folder",
    )
    parser.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="host RAM the memory plan must fit (default: this machine's, or its cgroup limit)",
    )
    parser.add_argument(
        "--device-memory",
        type=float,
        metavar="GIB",
        help="accelerator memory the memory plan must fit (default: the device's)",
    )
    parser.add_argument(
        "--inspect",
        action="store_true",
        help="report on the configured datasets and exit (scripts/inspect_data.py --help)",
    )
    # The original launchers' options, translated with a notice (docs/migrating.md).
    parser.add_argument(
        "--data_root", help="legacy: sets data.params.{train,validation}.params.data_root"
    )
    parser.add_argument(
        "--gpus", help="legacy: '0,' or '0,1' (indices) or a count -> lightning.trainer.devices"
    )
    parser.add_argument(
        "--validate-only",
        nargs="?",
        const=True,
        default=False,
        metavar="CKPT_OR_RUN",
        help="print the fixed-noise validation loss of a checkpoint (or of --resume's) and exit; "
        "writes nothing into the run folder (lun/validate_only.py)",
    )
    parser.add_argument("--out", help="--validate-only: also write the figures to this JSON file")
    parser.add_argument(
        "--raw-weights", action="store_true", help="--validate-only: not the EMA weights"
    )
    opt, dotlist = parser.parse_known_args(
        fold_switch_values(sys.argv[1:] if argv is None else argv)
    )
    # `--base a.yaml b.yaml key=value ~key` puts overrides into --base's list: move them out.
    overrides = [a for a in opt.base if "=" in a or a.startswith("~")]
    dotlist = overrides + dotlist
    opt.base = [a for a in opt.base if a not in overrides]
    return opt, dotlist


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from lun import quiet

    quiet.install()  # before the heavy imports: bitsandbytes prints at import
    if "--inspect" in argv:  # the dataset report: same config merge, no model, no run folder
        from lun.data.dataset_report import main as inspect_data

        return inspect_data([a for a in argv if a != "--inspect"])
    opt, dotlist = parse_args(argv)
    # Our loggers only: Lightning prints its own messages through its own handler.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("ldm", "lun"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG if opt.debug else logging.INFO)
    try:
        return run(opt, dotlist)
    except ConfigError as err:
        if opt.debug:
            traceback.print_exc()
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except pickle.UnpicklingError as err:  # ldm.safe_load.UnsafeCheckpointError: names the file
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from lun.callbacks.nan_guard import (
            NonFiniteLossError,  # imported here: Lightning is slow to import
        )

        if not isinstance(err, NonFiniteLossError):
            raise
        print(f"training stopped: {err}", file=sys.stderr)  # the guard saved the last good state
        return 1
    finally:  # called in-process (tests), a handler left on an old stderr would outlive it
        for name in ("ldm", "lun"):
            logging.getLogger(name).removeHandler(handler)
        release_process_group()


def release_process_group() -> None:
    """Close the DDP process group before exit: left to interpreter shutdown, gloo's threads can
    abort a finished run ("terminate called without an active exception", exit -6)."""
    dist = sys.modules.get("torch.distributed")  # never imported: nothing to close
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Launch:
    """What `resolve` decides before anything is built: the merged config (resolved, and as
    written), the run folder, the checkpoint a resume or validation starts from."""

    config: dict
    as_written: DictConfig
    run_dir: RunDir
    ckpt_path: Path | None
    remote: object | None  # lun.remote.RemoteRun (Lightning-heavy: imported when needed)


def run(opt: argparse.Namespace, dotlist: list[str]) -> int:
    from lun.run import hold_save_signal

    hold_save_signal()  # before anything slow: SIGUSR1 would kill the process until fit starts
    launch = resolve(opt, dotlist)
    built = build(opt, launch)
    return train(opt, launch, *built)


def resolve(opt: argparse.Namespace, dotlist: list[str]) -> Launch:
    """Step 1: the config (files, command line, a resumed run's saved configs, the legacy
    spellings translated), the run folder and checkpoint; checked before anything is built."""
    unknown = [a for a in dotlist if a.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]} (see --help)")
    cfg = merge_configs(opt.base, dotlist) if opt.base else None
    legacy = legacy_resume(cfg) if cfg is not None else None  # Lightning 1.x's way to --resume
    if legacy and opt.resume:
        raise ConfigError("give --resume or lightning.trainer.resume_from_checkpoint, not both")
    resume = opt.resume or legacy or (opt.validate_only if opt.validate_only is not True else "")
    if not opt.base and not resume and not dotlist:
        raise ConfigError("nothing to run: give --base CONFIG.yaml or --resume RUN (see --help)")
    cfg, run_dir, ckpt_path, remote = _run_folder(opt, cfg, dotlist, resume)
    translate_command_line(cfg, opt.data_root, opt.gpus)
    for section in ("model", "data"):
        if section not in cfg:
            raise ConfigError(f"the merged config has no '{section}' section")
    # Saved as written, interpolations kept (check_complete resolves cfg in place): a resume
    # with another max_steps moves what follows it (`total_steps: ${lightning.trainer.max_steps}`).
    as_written = copy.deepcopy(cfg)
    check_complete(cfg)
    config = to_container(cfg)
    from ldm.checkpoint import check_config_files

    try:  # a mistyped ckpt_path, another family's file: one line, before anything is built
        flag = "--resume" if opt.resume or legacy else "--validate-only"
        check_config_files(config["model"], ckpt_path, opt.unsafe_load, flag)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return Launch(config, as_written, run_dir, ckpt_path, remote)


def _run_folder(opt, cfg, dotlist: list[str], resume: str):
    """(config, run folder, checkpoint, remote): a resumed run's (its saved configs unless
    --base is given), or a new one's."""
    from lun.remote import new_run, resolve_resume
    from lun.run import resume_target, saved_configs

    if not resume:
        cfg = cfg if cfg is not None else merge_configs([], dotlist)
        name = opt.name or (Path(opt.base[0]).stem if opt.base else "run")
        run_dir, remote = new_run(opt.logdir, name, opt.postfix)  # remote: mirrors a URL's
        return cfg, run_dir, None, remote
    resume, remote = resolve_resume(resume)  # s3://...: downloaded into a staging folder
    verb = "validating" if opt.validate_only else "resuming from"
    verb = verb if opt.train or opt.validate_only else "would resume from"
    from lun.strategies import check_checkpoint  # pickled code refused before Lightning loads

    run_dir, ckpt_path = resume_target(
        resume, verb, check=lambda path: check_checkpoint(path, unsafe=opt.unsafe_load)
    )
    if cfg is None:
        cfg = merge_configs(saved_configs(run_dir), dotlist)
    return cfg, run_dir, ckpt_path, remote


def build(opt: argparse.Namespace, launch: Launch) -> tuple:
    """Step 2: (data, trainer, model), built and checked before the run folder exists. A value
    refused with a ValueError (unknown target or parameter, a constructor's check) is a config
    error; a TypeError raised inside a constructor is a bug and keeps its traceback."""
    from lightning.pytorch import seed_everything

    from lun.data.latent_cache import check_cached_data
    from lun.run import check_strategy_fits
    from lun.trainer import (
        build_data,
        build_model,
        build_trainer,
        clipping_problem,
        image_size_problem,
    )

    config = launch.config
    model_params = config["model"].setdefault("params", {})
    seed_everything(opt.seed, workers=True)
    try:
        data = build_data(config["data"])  # its datasets indexed, a first image decoded
        data_params = config["data"].get("params") or {}
        # The original configs' `model.params.use_ema` switches on the EMA callback.
        use_ema = bool(model_params.get("use_ema", False))
        lightning_cfg = config.get("lightning") or {}
        trainer = build_trainer(lightning_cfg, launch.run_dir, "validation" in data_params, use_ema)
        set_learning_rate(config["model"], opt.scale_lr, data, trainer)
        model = build_model(config["model"])
        check_cached_data(data, model)  # a cache made with other weights: stop before the run
        check_strategy_fits(model, trainer.strategy, resuming=launch.ckpt_path is not None)
        problems = [clipping_problem(model, trainer), image_size_problem(model, data)]
        for problem in problems + resume_problems(opt, launch, model, trainer):
            if problem:
                raise ConfigError(problem)
        if launch.remote is not None:
            launch.remote.attach(trainer)
    except ValueError as err:  # what lun.trainer's builders did not already name
        raise ConfigError(str(err).strip().splitlines()[0]) from err
    return data, trainer, model


def resume_problems(opt: argparse.Namespace, launch: Launch, model, trainer) -> list:
    """What a resume would meet inside fit, after the run folder took the config: tensors of
    other shapes than the checkpoint's, or no step left to train."""
    from lun.run import nothing_left_problem
    from lun.strategies import shape_problem

    if launch.ckpt_path is None:
        return []
    problems = [shape_problem(launch.ckpt_path, model, opt.unsafe_load)]
    if not opt.validate_only:
        steps, epochs = trainer.max_steps, trainer.max_epochs
        problems.append(nothing_left_problem(launch.ckpt_path, steps, epochs))
    return problems


def set_learning_rate(model_config: dict, scale_lr: bool, data, trainer) -> None:
    """The learning rate is a constructor value (lun.contract): written before building."""
    base_lr = model_config.get("base_learning_rate")
    if base_lr is not None:
        if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or base_lr <= 0:
            raise ConfigError(f"model.base_learning_rate: {base_lr!r} is not a positive number")
        lr = scaled_learning_rate(base_lr, data, trainer) if scale_lr else base_lr
        model_config["params"]["learning_rate"] = lr
    elif scale_lr:
        raise ConfigError("--scale_lr needs model.base_learning_rate (the per-sample rate)")


def train(opt: argparse.Namespace, launch: Launch, data, trainer, model) -> int:
    """Step 3: validate only, or plan the memory, make the run folder, fit, then test."""
    from lun.run import is_rank_zero

    if opt.validate_only:  # before the run folder: validating writes nothing there
        from lun.validate_only import validate_checkpoint

        if launch.ckpt_path is None:
            print("validating the weights the config builds")
        lightning_cfg = launch.config.get("lightning") or {}
        return validate_checkpoint(
            model, data, lightning_cfg, launch.ckpt_path, opt.out, opt.raw_weights, opt.unsafe_load
        )
    # The memory plan, before the run folder: a run that cannot fit stops here (exit 2). Other
    # ranks are started by rank 0's `fit`, after its plan passed.
    plan = None
    if is_rank_zero() and (opt.train or opt.plan):
        from lun.memory import plan_run

        plan = plan_run(model, data, trainer, opt.host_memory, opt.device_memory)
        print(plan.table() if opt.plan or plan.tight() else plan.line())
        plan.check()
    if opt.plan:
        return 0
    if not opt.train:  # a check writes nothing: no run folder, a resumed run untouched
        print("config checked; add -t to train")
        return 0
    if is_rank_zero():
        create_run_folder(launch, plan)
    status = fit(opt, launch, data, trainer, model)
    if status is None and not opt.no_test and "test" in (launch.config["data"].get("params") or {}):
        trainer.test(model, datamodule=data)
    return status or 0


def create_run_folder(launch: Launch, plan) -> None:
    launch.run_dir.create()
    launch.run_dir.save_configs(launch.as_written)
    if plan is not None:
        plan.save(launch.run_dir.root / "memory-plan.json")
    if launch.remote is not None:
        launch.remote.sync()
    print(f"run folder: {launch.remote.url if launch.remote else launch.run_dir.root}")


def fit(opt: argparse.Namespace, launch: Launch, data, trainer, model) -> int | None:
    """`trainer.fit`; the exit status of a run stopped by a signal, None when it finished."""
    ckpt_path = launch.ckpt_path
    try:
        trainer.fit(
            model,
            datamodule=data,
            ckpt_path=str(ckpt_path) if ckpt_path else None,
            weights_only=False if opt.unsafe_load else None,  # None: strategies check the pickles
        )
    except SystemExit as stop:  # SIGTERM or Ctrl-C, after on_exception.ckpt: 143 or 130
        from lun.callbacks.signals import exit_status

        if exit_status(stop) is None:
            raise
        return exit_status(stop)
    except RuntimeError as err:  # an allocator's refusal (a step, sampling): the plan's line
        from lun.memory import is_out_of_memory, out_of_memory_in_training

        if not is_out_of_memory(err):
            raise
        raise out_of_memory_in_training(err, trainer) from err
    finally:
        if launch.remote is not None:
            launch.remote.sync()  # what the loggers wrote last, after every callback
    return None


def scaled_learning_rate(base_lr: float, data, trainer) -> float:
    batch_size = data.batch_size("train")
    accumulate = trainer.accumulate_grad_batches
    devices, nodes = trainer.num_devices, trainer.num_nodes
    lr = accumulate * devices * nodes * batch_size * base_lr
    print(
        f"learning rate {lr:.2e} = {accumulate} (accumulate) x {devices} (devices) x {nodes} (nodes) "
        f"x {batch_size} (batch size) x {base_lr:.2e} (base_learning_rate)"
    )
    return lr


if __name__ == "__main__":
    status = main()
    # Everything is saved and closed by now. Freezing the objects spares the interpreter's last
    # full garbage collection over every torch / Lightning / DeepSpeed object at exit (1-2 s for
    # a one-process run, several s a rank with DeepSpeed); atexit handlers still run.
    gc.freeze()
    sys.exit(status)
