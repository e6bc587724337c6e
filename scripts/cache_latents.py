"""Encode a training set once: VAE latents (and text-encoder outputs) into a reusable cache.

    python scripts/cache_latents.py --base configs/stable-diffusion/v1-finetune.yaml mine.yaml \\
        --out cache/mine [--text] [--sample] [--processes 2]
    torchrun --nproc-per-node 4 scripts/cache_latents.py --base ... --out cache/mine
    # then train with it:
    python main.py --base ... data.params.cache=cache/mine -t

The configs merge as main.py merges them (files left to right, `key=value` overrides last); the
model is built as for training (its `ckpt_path` weights) and the training set
`data.params.train` is encoded. `--out` defaults to `data.params.cache`. A rerun encodes only
what changed (new or changed images or captions, changed settings) and says how many; after a
crash it keeps the shards already written. See lun/data/latent_cache.py for what is stored and
how the keys are made.
"""

import argparse
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    from lun.cli import HelpFormatter, seed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-b", "--base", nargs="*", default=[], metavar="config.yaml")
    parser.add_argument("--out", help="cache folder (default: data.params.cache)")
    parser.add_argument(
        "--text", action="store_true", help="also cache the (frozen) text encoder's outputs"
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="store one latent drawn from the posterior (x scale_factor) instead of its moments",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="images per encoder call")
    parser.add_argument("--shard-size", type=int, default=256, help="items per shard file")
    parser.add_argument("--workers", type=int, default=None, help="decoding processes per rank")
    parser.add_argument("--processes", type=int, default=1, help="encoding processes to start")
    parser.add_argument(
        "-s",
        "--seed",
        type=seed,
        default=23,
        help="global seed, as main.py's (random-init weights)",
    )
    parser.add_argument("--device", help="default: the accelerator if there is one, else cpu")
    opt, dotlist = parser.parse_known_args(argv)
    overrides = [a for a in opt.base if "=" in a or a.startswith("~")]
    opt.base = [a for a in opt.base if a not in overrides]
    return opt, overrides + dotlist


def load_config(opt, dotlist) -> dict:
    from lun.config import ConfigError, check_complete, merge_configs, to_container
    from lun.legacy import translate_legacy_keys

    unknown = [a for a in dotlist if a.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]} (see --help)")
    if not opt.base:
        raise ConfigError("--base: give the training configs")
    cfg = merge_configs(opt.base, dotlist)
    translate_legacy_keys(cfg)
    check_complete(cfg)
    config = to_container(cfg)
    from ldm.checkpoint import check_config_files

    for section in ("model", "data"):
        if section not in config:
            raise ConfigError(f"the merged config has no '{section}' section")
    try:  # a mistyped or another family's ckpt_path: one line, before building
        check_config_files(config["model"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    params = config["data"].get("params") or {}
    if params.get("train") is None:
        raise ConfigError("data.params.train: no training set to cache")
    opt.out = opt.out or params.get("cache")
    if not opt.out:
        raise ConfigError("--out: give the cache folder (or set data.params.cache)")
    if os.path.exists(opt.out) and not os.path.isdir(opt.out):
        raise ConfigError(f"{opt.out}: is a file, not a folder; give the cache folder as --out")
    return config


def pick_device(name: str | None, rank: int):
    import torch

    if name:
        return torch.device(name)
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        return torch.device(kind, rank % torch.accelerator.device_count())
    return torch.device("cpu")


def made_with(opt, dotlist) -> list[str]:
    """What the cache's refresh command repeats (the training-side check prints `python
    scripts/cache_latents.py --base <these> --out DIR`): the configs and `key=value` overrides as
    they were typed - a `data_root` given on the command line included - and the flags that
    decide what is cached, each quoted for a shell."""
    flags = [flag for flag, on in (("--text", opt.text), ("--sample", opt.sample)) if on]
    return [shlex.quote(arg) for arg in [*opt.base, *dotlist, *flags]]


def run(opt, dotlist) -> int:
    import torch
    from lightning.pytorch import seed_everything

    from ldm.util import instantiate_from_config
    from lun.config import ConfigError, config_errors
    from lun.data import latent_cache as cache
    from lun.data import latent_cache_build as build
    from lun.trainer import build_model

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    config = load_config(opt, dotlist)
    params = config["data"]["params"]
    workers = opt.workers if opt.workers is not None else int(params.get("num_workers", 0))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    seed_everything(opt.seed, workers=True)  # as main.py: weights not loaded from a file agree
    with config_errors("data.params.train", params["train"]):
        dataset = instantiate_from_config(params["train"])
        cache.check_cacheable(dataset, opt.text)
    model = build_model(config["model"])
    if opt.text and not model.caption_conditioning_frozen:
        raise ConfigError(
            "--text: the text encoder is trained (or does not read captions): its outputs "
            "change every step and cannot be cached; cache the latents only"
        )
    device = pick_device(opt.device, rank)
    model.encoders_to(device)  # the backbone is not needed: it stays where it is
    fingerprints = {
        **model.cache_fingerprint(text=opt.text),
        "kind": "sample" if opt.sample else "posterior",
    }
    os.makedirs(opt.out, exist_ok=True)
    try:
        previous = cache.read_index(opt.out, missing_ok=True)
    except ValueError:
        previous = None  # not ours, or another version: everything is encoded again
    plan = build.make_plan(dataset, fingerprints, previous, opt.text, opt.out, opt.shard_size)
    plan.made_with = made_with(opt, dotlist)
    if opt.text:
        plan.text_fields = sorted(model.encode_captions([""]))
    if rank == 0:
        print(plan.summary())
        if dataset.flip_p == 0:
            print("flips are off (flip_p: 0): one orientation cached per image")
    build.build_shards(plan, dataset, model, rank, world_size, opt.batch_size, workers)
    if build.finish(plan):
        print(f"cache {opt.out}: ready; train with data.params.cache={opt.out}")
    else:
        print(f"rank {rank}: done; the last rank to finish writes the index")
    return 0


def spawn(opt, argv) -> int:
    """`--processes N`: this script again in N processes, as torchrun would start it."""
    args, skip = [], False
    for arg in argv:  # drop "--processes N" / "--processes=N"
        if not skip and arg != "--processes" and not arg.startswith("--processes="):
            args.append(arg)
        skip = arg == "--processes"
    children = []
    for rank in range(opt.processes):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(opt.processes)}
        children.append(subprocess.Popen([sys.executable, __file__, *args], env=env))
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opt, dotlist = parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ("ldm", "lun")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        return _main(opt, dotlist, argv)
    finally:  # called in-process (tests), a handler left on an old stderr would outlive it
        for logger in loggers:
            logger.removeHandler(handler)


def check_options(opt) -> None:
    """ConfigError naming the first option out of range, before a process is started or a model
    built (a batch size of 0 failed mid-run; a negative shard size wrote an empty cache)."""
    from lun.config import ConfigError

    for flag, value, lowest in (
        ("--batch-size", opt.batch_size, 1),
        ("--shard-size", opt.shard_size, 1),
        ("--processes", opt.processes, 1),
        ("--workers", opt.workers, 0),
    ):
        if value is not None and value < lowest:
            raise ConfigError(f"{flag}={value}: expected a whole number >= {lowest}")


def _main(opt, dotlist, argv) -> int:
    from lun.config import ConfigError

    try:
        check_options(opt)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if opt.processes > 1 and "RANK" not in os.environ:
        return spawn(opt, argv)
    try:
        return run(opt, dotlist)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a constructor or the cache refusing a value
        print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    sys.exit(main())
