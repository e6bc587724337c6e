"""The training loop's own cost: `main.py` (Lightning and every default callback) against a plain
PyTorch loop of the same model, data and optimizer, in one process.

    python scripts/benchmark_loop.py                       # the demo model (configs/demo/shapes.yaml)
    python scripts/benchmark.py --only loop

Both sides build the model, data module and optimizer (with its LR schedule) from the same
config through the same functions (`lun.trainer.build_model`, `build_data`,
`configure_optimizers`), seed 0, one thread. The plain loop is

    for batch in loader: loss = model.diffusion_loss(batch)[0]; loss.backward();
                         optimizer.step(); scheduler.step(); optimizer.zero_grad(set_to_none=True)

and `main.py` runs `-t` on the config with its defaults (progress bar, throughput, checkpoints,
NaN guard, LR monitor, RNG state; the demo's EMA). Two pieces of main.py's step are work a bare
loop does not do at all: the NaN/inf check of the gradients (so a bad step is skipped) and the
EMA fold. The plain loop therefore runs twice, bare and with the same two pieces done by hand
(`same_work`), and the loop's own overhead is main.py minus the plain loop with the same work;
the cost of the two pieces is printed on its own row (the EMA's share of the step is also what
the EMA callback prints when training starts). The three runs alternate for `--rounds` rounds
and each figure is the median over the rounds (a shared machine's load drifts). Printed: ms per
optimizer step after the warm-up, in wall time and in CPU time of the process (all its threads:
on a loaded, shared machine the CPU figures are the steadier). Host reads of tensor values
(`.item()`, `bool()`, `float()`, `.tolist()`: the host-device syncs on an accelerator) are
counted per step of main.py, and the steps that had one are listed: only logging steps and
epoch ends should.
"""

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torch is imported in the functions: --help answers without it.
REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo" / "shapes.yaml"
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
# Host reads of tensors that are on the host by design, not syncs with a device: the data
# pipeline (it runs in the loader's workers when there are any) and the caption dropout mask of
# classifier-free guidance (drawn on the CPU, read to pick the captions).
ON_THE_HOST = ("/torch/utils/data/", "ldm/data", "lun/data/", "ldm/conditioning.py")


def on_the_host(frame) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in ON_THE_HOST):
            return True
        frame = frame.f_back
    return False


class StepClock:
    """A callback: the time of every optimizer step's end, and the host reads made in each step
    (from one step's `on_train_batch_start` to the next's, so a step's logging counts for it)."""

    def __init__(self):
        from lightning.pytorch.callbacks import Callback

        class Clock(Callback):
            def on_train_batch_start(clock, trainer, pl_module, batch, batch_idx):
                self.step = trainer.global_step + 1

            def on_train_batch_end(clock, trainer, pl_module, outputs, batch, batch_idx):
                self.ends.append(time.perf_counter())
                self.cpu_ends.append(time.process_time())

        self.callback = Clock()
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # CPU seconds of the process (all its threads)
        self.step = 0
        self.reads: dict[int, int] = {}

    @contextlib.contextmanager
    def counting_host_reads(self):
        """Count calls of the Tensor methods that read a value on the host, by step."""
        import torch

        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def counted(original):
            def read(tensor, *args, **kwargs):
                if self.step and not on_the_host(sys._getframe(1)):
                    self.reads[self.step] = self.reads.get(self.step, 0) + 1
                return original(tensor, *args, **kwargs)

            return read

        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def overrides(
    data_root: Path, steps: int, width: int, batch_size: int, every: int, device: str = "cpu"
) -> list[str]:
    # Both sides on one device in fp32: the demo config picks no accelerator, and Lightning
    # would take a GPU where the plain loop runs on the CPU.
    return [
        f"lightning.trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
        "lightning.trainer.devices=1",
        "lightning.trainer.precision=32",
        f"data.params.train.params.data_root={data_root}",
        f"data.params.batch_size={batch_size}",
        f"model.params.unet_config.params.model_channels={width}",
        f"lightning.trainer.max_steps={steps}",
        f"lightning.trainer.log_every_n_steps={every}",
        f"lightning.callbacks.progress_bar.params.log_every_n_steps={every}",
    ]


def main_py_loop(config: Path, dotlist: list[str], logdir: Path) -> StepClock:
    """Run main.py in this process with a StepClock among its callbacks."""
    sys.path.insert(0, str(REPO))
    import lun.trainer
    import main as launcher

    clock, build = StepClock(), lun.trainer.build_callbacks

    def with_clock(*args, **kwargs):
        return [clock.callback, *build(*args, **kwargs)]

    lun.trainer.build_callbacks = with_clock
    try:
        with clock.counting_host_reads():
            code = launcher.main(["--base", str(config), "-t", "--logdir", str(logdir), *dotlist])
    finally:
        lun.trainer.build_callbacks = build
    if code:
        raise SystemExit(f"main.py exited with {code}")
    return clock


def merged_config(config: Path, dotlist: list[str]) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(dotlist))
    return OmegaConf.to_container(cfg, resolve=True)


def ema_decay(cfg: dict) -> float | None:
    """The decay of the config's EMA callback (None: the config has none)."""
    ema = ((cfg.get("lightning") or {}).get("callbacks") or {}).get("ema")
    if not ema and not cfg["model"].get("params", {}).get("use_ema"):
        return None
    return float(((ema or {}).get("params") or {}).get("decay", 0.9999))


def plain_loop(
    config: Path, dotlist: list[str], steps: int, device: str = "cpu", same_work: bool = False
) -> tuple[list[float], list[float]]:
    """The same model, data and optimizer in a for loop on `device`; the wall and CPU time of
    every step's end (on a GPU the queue of launched work fills within a few steps, so the
    median interval is the step's time without a synchronisation per step).

    `same_work`: also do, by hand, the two pieces of work main.py's defaults add to every step,
    so that the difference is the loop's own cost: the NaN/inf check of the gradients handed to
    the fused optimizer as `found_inf` (one fused pass over the gradients), and, when the config
    has an EMA, its fold into fp32 shadows (one `_foreach_lerp_` with LitEma's warm-up)."""
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch import seed_everything

    from lun.callbacks.nan_guard import nonfinite_flag
    from lun.trainer import build_data, build_model

    seed_everything(0, verbose=False)
    cfg = merged_config(config, dotlist)
    model, data = build_model(cfg["model"]).to(device), build_data(cfg["data"])
    data.setup("fit")
    model.learning_rate = cfg["model"]["base_learning_rate"]
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured.get("lr_scheduler") if isinstance(configured, dict) else None
    scheduler = scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = ema_decay(cfg) if same_work else None
    ema = None if decay is None else [p for p in model.ema_module.parameters() if p.requires_grad]
    shadows = None if ema is None else [p.detach().float().clone() for p in ema]
    ends, cpu_ends = [], []
    while len(ends) < steps:
        for batch in data.train_dataloader():
            loss = model.diffusion_loss(move_data_to_device(batch, device))[0]
            loss.backward()
            if same_work:
                grads = [p.grad for p in params if p.grad is not None]
                optimizer.found_inf = nonfinite_flag(grads)  # the NaN guard's one pass
            optimizer.step()
            optimizer.__dict__.pop("found_inf", None)
            if shadows is not None:
                n = len(ends) + 1  # LitEma: min(decay, (1 + n) / (10 + n))
                weight = 1.0 - min(decay, (1 + n) / (10 + n))
                torch._foreach_lerp_(shadows, [p.detach() for p in ema], weight)
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            if len(ends) == steps:
                break
    return ends, cpu_ends


def median_ms(ends: list[float], warmup: int) -> float:
    return 1e3 * statistics.median(b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :]))


def make_data(folder: Path, n: int) -> Path:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_shapes.py"), "--out", str(folder)]
        + ["--n", str(n), "--size", "16", "--seed", "0"],
        check=True,
        capture_output=True,
    )
    return folder


def loop_table(args, tmp: Path) -> list[str]:
    """Rounds of (plain loop, plain loop + the same work, main.py), alternating: each figure is
    the median over the rounds of the median step (a shared machine's load drifts)."""
    import torch

    torch.set_num_threads(args.threads)
    data = make_data(tmp / "shapes", args.images)
    steps = args.warmup + args.steps
    dotlist = overrides(data, steps, args.width, args.batch_size, args.log_every, args.device)
    config = Path(args.config)
    runs = {"plain": [], "same": [], "main": []}  # (wall, CPU) ms per step, one per round
    reads = {}
    for round_ in range(args.rounds):
        for same_work in (False, True):
            ends = plain_loop(config, dotlist, steps, args.device, same_work=same_work)
            runs["same" if same_work else "plain"].append(
                tuple(median_ms(e, args.warmup) for e in ends)
            )
        clock = main_py_loop(config, dotlist, tmp / f"logs{round_}")
        runs["main"].append(
            (median_ms(clock.ends, args.warmup), median_ms(clock.cpu_ends, args.warmup))
        )
        reads = clock.reads
    wall, cpu = (
        {name: statistics.median(r[k] for r in rounds) for name, rounds in runs.items()}
        for k in (0, 1)
    )
    overheads = [m[1] - s[1] for m, s in zip(runs["main"], runs["same"], strict=True)]
    synced = sorted(s for s in reads if s > 1)
    has_ema = ema_decay(merged_config(config, dotlist)) is not None
    work = "NaN/inf check" + (" and EMA fold" if has_ema else "")
    title = (
        f"loop ({config.name}, width {args.width}, batch {args.batch_size}, {args.device}, "
        f"{args.threads} thread; median of {args.rounds} alternating rounds)"
    )
    rows = format_loop_table(title, wall, cpu, overheads, work, synced, args.log_every)
    print("\n".join(rows), flush=True)
    return rows


def format_loop_table(
    title: str,
    wall: dict,
    cpu: dict,
    overheads: list[float],
    work: str,
    synced: list[int],
    log_every: int,
) -> list[str]:
    """The printed table: `wall` / `cpu` ms per step of the plain loop ("plain"), the plain loop
    with main.py's work ("same") and main.py ("main"); `overheads` per round (CPU ms)."""
    return [
        f"| {title} | wall ms/step | CPU ms/step |",
        "|---|---|---|",
        f"| plain PyTorch loop | {wall['plain']:.1f} | {cpu['plain']:.1f} |",
        f"| plain loop + the same {work} as main.py's defaults "
        f"| {wall['same']:.1f} | {cpu['same']:.1f} |",
        f"| main.py, every default callback | {wall['main']:.1f} | {cpu['main']:.1f} |",
        f"| {work} (both sides) | {wall['same'] - wall['plain']:+.1f} "
        f"| {cpu['same'] - cpu['plain']:+.1f} |",
        f"| overhead of the loop (main.py - plain loop + the same work) "
        f"| {wall['main'] - wall['same']:+.1f} ({wall['main'] / wall['same']:.2f}x) "
        f"| {cpu['main'] - cpu['same']:+.1f} ({cpu['main'] / cpu['same']:.2f}x); "
        f"rounds {', '.join(f'{o:+.1f}' for o in overheads)} |",
        f"| steps of main.py with host reads (after step 1; logging every {log_every}) "
        f"| {synced} | |",
    ]


def parse_args(argv=None):
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", default=str(DEMO), help="the config both sides train")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--width", type=int, default=32, help="UNet model_channels")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step")
    parser.add_argument("--images", type=int, default=256, help="generated training images")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternating rounds of the three (more on a busy machine)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--log-every", type=int, default=25, help="main.py's log_every_n_steps")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where both sides train"
    )
    return parser.parse_args(argv)


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return loop_table(args, Path(tmp))


if __name__ == "__main__":
    main()
