"""The fixed-noise validation loss (ldm/validation.py) through a short shapes-demo run, and what
validating costs: the figures per timestep bucket before training and at every validation, and
the validation time as a share of the training time.

    python scripts/make_shapes.py --out data/shapes --n 4000 --size 16 --seed 0
    python scripts/make_shapes.py --out data/shapes_val --n 256 --size 16 --seed 1
    python scripts/validation_demo.py --steps 200 --every 50 data.params.validation.params.limit_images=128

It trains configs/demo/shapes.yaml with VALIDATION below as its held-out set (another seed of
make_shapes: none of its images is a training image; its EMA validates, as in a run) and writes
nothing. Timings on a shared machine are noisy: repeat them.
"""

import argparse
import time
from pathlib import Path

# torch, Lightning and the models are imported in the functions: --help answers without them.
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo/shapes.yaml"
# The demo's held-out set, as a run's config would give it.
VALIDATION = [
    "data.params.validation.target=lun.data.local.Local",
    "data.params.validation.params.data_root=data/shapes_val",
    "data.params.validation.params.size=16",
    "data.params.validation.batch_size=128",
    "lightning.trainer.check_val_every_n_epoch=null",  # val_check_interval counts steps
]


def make_clock():
    """A `Clock` callback (the class is made here: its base is Lightning's)."""
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        """Seconds spent in training batches and in validation passes; the figures of each pass."""

        def __init__(self):
            self.train = self.validation = 0.0
            self.rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.train += time.perf_counter() - self._start

        def on_validation_start(self, trainer, pl_module):
            self._start_validation = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            self.validation += time.perf_counter() - self._start_validation
            self.rows.append((trainer.global_step, dict(pl_module.validation_loss.last)))
            figures = " ".join(f"{k}={v:.4f}" for k, v in self.rows[-1][1].items())
            print(f"step {trainer.global_step}: {figures}", flush=True)

    return Clock()


def main() -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--every", type=int, default=100, help="steps between validations")
    parser.add_argument("--seed", type=int, default=23, help="seed of the run")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the configs")
    args = parser.parse_args()
    import lightning.pytorch as pl
    import torch

    from ldm.util import instantiate_from_config
    from lun.config import merge_configs, to_container
    from lun.trainer import build_data, build_model

    dotlist = [
        *VALIDATION,
        f"lightning.trainer.max_steps={args.steps}",
        f"lightning.trainer.val_check_interval={args.every}",
        *args.overrides,
    ]
    config = to_container(merge_configs([str(CONFIG)], dotlist))
    pl.seed_everything(args.seed, workers=True)
    data, model = build_data(config["data"]), build_model(config["model"])
    model.learning_rate = config["model"]["base_learning_rate"]
    ema = instantiate_from_config(config["lightning"]["callbacks"]["ema"])
    clock = make_clock()
    trainer_args = dict(config["lightning"]["trainer"])
    trainer_args.update(use_distributed_sampler=False, enable_progress_bar=False)
    trainer = pl.Trainer(
        **trainer_args, callbacks=[ema, clock], logger=False, enable_checkpointing=False
    )
    trainer.validate(model, datamodule=data, verbose=False)  # step 0: before training
    clock.validation = 0.0  # only the validations inside the run count as overhead
    trainer.fit(model, datamodule=data)

    names = list(clock.rows[0][1])
    print(
        f"validation loss on {model.validation_loss.items} held-out items (step 0: the initial weights; then the EMA weights)"
    )
    print("| step | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for step, figures in clock.rows:
        print(f"| {step} | " + " | ".join(f"{figures[n]:.4f}" for n in names) + " |")
    validations = len(clock.rows) - 1
    print(
        f"validation: {clock.validation:.1f} s in {validations} passes, training: "
        f"{clock.train:.1f} s in {args.steps} steps -> overhead "
        f"{100 * clock.validation / clock.train:.1f} % of the training time "
        f"(every {args.every} steps); torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
