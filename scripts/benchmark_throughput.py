"""What the Throughput callback costs a run of the tiny config (configs/tiny/ldm.yaml).

    python scripts/benchmark_throughput.py --steps 40 --repeats 3

Prints: the time spent in the callback's hooks as a share of the step time (the steady cost,
with a window closed and logged to TensorBoard every step, the tiny config's
`log_every_n_steps: 1`); the one-time costs (the FLOP-counted first step against a plain one,
the matmul probe); and the median step time with and without the callback, runs taking turns.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch and Lightning are imported in the functions: --help answers without them.
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "ldm.yaml"
HOOKS = ("on_train_batch_start", "on_after_backward", "on_train_batch_end")


class Images:
    """A map-style dataset of random images (DataLoader needs only __len__ and __getitem__)."""

    def __len__(self):
        return 10**6

    def __getitem__(self, index):
        import torch

        g = torch.Generator().manual_seed(index)
        return {"image": torch.rand(3, 32, 32, generator=g) * 2 - 1, "caption": f"shape {index}"}


def timing_callbacks():
    """The two timing callbacks (classes made here: their bases are Lightning's)."""
    import lightning.pytorch as pl

    from lun.callbacks import throughput as tp

    class StepTimes(pl.Callback):
        """Seconds from one batch start to the next."""

        def __init__(self):
            self.starts = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def seconds(self) -> list[float]:
            return [b - a for a, b in zip(self.starts, self.starts[1:])]

    class TimedThroughput(tp.Throughput):
        """The callback, with the time spent in each of its per-step hooks added up per batch."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hook_seconds: list[float] = []
            for name in HOOKS:
                setattr(self, name, self._timed(getattr(self, name), name))

        def _timed(self, hook, name):
            def run(*args, **kwargs):
                start = time.perf_counter()
                hook(*args, **kwargs)
                if name == "on_train_batch_start":
                    self.hook_seconds.append(0.0)
                self.hook_seconds[-1] += time.perf_counter() - start

            return run

    return StepTimes, TimedThroughput


def fit(steps: int, callbacks: list, logdir: str) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from ldm.util import instantiate_from_config

    config = OmegaConf.to_container(OmegaConf.load(TINY)["model"])
    torch.manual_seed(0)
    model = instantiate_from_config(config)
    model.learning_rate = 1e-4
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        log_every_n_steps=1,
        logger=TensorBoardLogger(logdir, name="tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(Images(), batch_size=2))


def main() -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs with and without the callback, taking turns"
    )
    args = parser.parse_args()
    import torch

    from lun.callbacks import throughput as tp

    StepTimes, TimedThroughput = timing_callbacks()
    logdir = tempfile.mkdtemp(prefix="throughput_bench_")

    start = time.perf_counter()
    tp.measured_matmul_flops(torch.device("cpu"), torch.float32)
    probe = time.perf_counter() - start

    with_cb, without, shares, counted = [], [], [], []
    for _ in range(args.repeats):
        timer, callback = StepTimes(), TimedThroughput()
        fit(args.steps, [callback, timer], logdir)
        steps = timer.seconds()  # step i: start of batch i to start of batch i + 1
        with_cb.append(statistics.median(steps[1:]))
        hooks = callback.hook_seconds[1 : len(steps)]  # the first step is the counted one
        shares.append(sum(hooks) / sum(steps[1:]))
        timer = StepTimes()
        fit(args.steps, [timer], logdir)
        without.append(statistics.median(timer.seconds()[1:]))
        counted.append(steps[0] - timer.seconds()[0])  # first steps: counted against plain

    print(f"tiny config, batch 2, 32 px, {args.steps} steps x {args.repeats} runs, CPU")
    print(f"time in the callback's hooks: {100 * statistics.median(shares):.2f} % of step time")
    print(
        f"median step: {statistics.median(with_cb) * 1e3:.1f} ms with the callback, "
        f"{statistics.median(without) * 1e3:.1f} ms without (runs taking turns)"
    )
    print(
        f"one-time: FLOP-counted first step +{statistics.median(counted):.2f} s, probe {probe:.2f} s"
    )


if __name__ == "__main__":
    main()
