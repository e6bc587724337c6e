"""Peak memory of a full-size Stable Diffusion 1.x fine-tune - training, saving, resuming - beside
the memory plan's prediction for each (the README's memory table).

    python scripts/memory_figures.py --workdir /tmp/sd-memory             # full size: ~24 GB RAM, ~25 GB disk
    python scripts/memory_figures.py --workdir /tmp/sd-small --width 32   # a reduced-width UNet, to check the script
    python scripts/memory_figures.py --plan-table   # the plan of SD 1.x / 2.x configurations

What it does, as a new user would: builds the model of `configs/stable-diffusion/v1-inference.yaml`
with random weights (1.07 B parameters at full size) and saves its state dict as the checkpoint
to start from; draws a few captioned 256 px images; trains `configs/stable-diffusion/v1-finetune.yaml`
on them (batch 1, 256 px, fp32, EMA on as the config ships it) for `--steps` steps with a
checkpoint after the second-last step and one when training ends, then resumes the last checkpoint for one more step. Each run is a
`main.py` subprocess whose resident memory (RSS) is sampled every 20 ms; a callback of this script
(`PhaseMarks`, loaded by the runs) writes when each step and save begins, so the samples fall into
phases:

    training   the training steps (forward, backward, optimizer, EMA), saves left out
    saving     from a checkpoint save until the next step
    resuming   the resumed run from its start until its first step (model build, memory plan,
               checkpoint restore)

The plan's predictions come from the `memory-plan.json` each run writes into its run folder.
"""

import argparse
import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_EVERY_S = 0.02
GB = 1e9


@functools.cache
def phase_marks_class() -> type:
    """`PhaseMarks`, made on first use: its base is Lightning's Callback (torch), which --help
    must not import."""
    from lightning.pytorch.callbacks import Callback

    class PhaseMarks(Callback):
        """Writes `<time> <phase>` lines: when each training step and checkpoint save begins."""

        def __init__(self, path: str):
            self.path = path

        def _mark(self, phase: str) -> None:
            with open(self.path, "a") as file:
                file.write(f"{time.time()} {phase}\n")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._mark("step")

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            self._mark("save")

        def on_train_end(self, trainer, pl_module) -> None:
            self._mark("end")

    return PhaseMarks


def __getattr__(name: str):
    # The runs load `memory_figures.PhaseMarks` by target (PEP 562 module __getattr__).
    if name == "PhaseMarks":
        return phase_marks_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_checkpoint(path: Path, width: int | None) -> int:
    """The v1 inference model with random weights, saved as an original-layout state dict."""
    import torch

    from ldm.util import instantiate_from_config
    from lun.config import merge_configs, to_container

    config = to_container(
        merge_configs([ROOT / "configs/stable-diffusion/v1-inference.yaml"], _width(width))
    )
    model = instantiate_from_config(config["model"])
    count = sum(p.numel() for p in model.parameters())
    torch.save({"state_dict": model.state_dict()}, path)
    return count


def _width(width: int | None) -> list[str]:
    return [] if width is None else [f"model.params.unet_config.params.model_channels={width}"]


def make_images(folder: Path, n: int = 8) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_shapes import make_shapes

    make_shapes(folder, n=n, size=256, seed=0)


def run_sampled(args: list[str], marks: Path) -> tuple[list[tuple[float, int]], float]:
    """Run `main.py ARGS`; (time, RSS) samples and the start time. Raises on failure."""
    env = {**_environ(), "PYTHONPATH": f"{ROOT}:{ROOT / 'scripts'}"}
    start = time.time()
    process = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *args], cwd=ROOT, env=env)
    samples = []
    watched = psutil.Process(process.pid)

    def sample():
        while process.poll() is None:
            try:
                samples.append((time.time(), watched.memory_info().rss))
            except psutil.Error:
                break
            time.sleep(SAMPLE_EVERY_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    status = process.wait()
    sampler.join()
    if status != 0:
        raise SystemExit(f"main.py {' '.join(args)} failed with exit status {status}")
    return samples, start


def _environ() -> dict:
    import os

    return dict(os.environ)


def read_marks(path: Path) -> list[tuple[float, str]]:
    return [
        (float(t), phase)
        for t, phase in (line.split(" ", 1) for line in path.read_text().splitlines())
    ]


def phase_peaks(samples, marks) -> dict[str, int]:
    """Peak RSS of each phase (see the module's docstring)."""
    peaks = {"startup": 0, "training": 0, "saving": 0}
    first_step = next(t for t, phase in marks if phase.strip() == "step")
    for t, rss in samples:
        if t < first_step:
            phase = "startup"
        else:
            last = max((m for m in marks if m[0] <= t), key=lambda m: m[0])
            phase = {"step": "training", "save": "saving"}.get(last[1].strip(), None)
            if phase is None:
                continue  # after the end: the process tears down
        peaks[phase] = max(peaks[phase], rss)
    return peaks


def plan_peaks(logs: Path) -> dict[str, int]:
    plan = json.loads(next(logs.glob("*/memory-plan.json")).read_text())
    return plan["peaks"]["host"]


# (label, precision, 8-bit AdamW) of the README's table of common configurations.
CONFIGURATIONS = [
    ("fp32 weights, AdamW", "32-true", False),
    ("fp32 weights (bf16-mixed), AdamW", "bf16-mixed", False),
    ("fp32 weights, 8-bit AdamW", "32-true", True),
    ("bf16 weights, AdamW", "bf16-true", False),
    ("bf16 weights, 8-bit AdamW", "bf16-true", True),
]


def plan_table() -> None:
    """The plan's parts for SD 1.x and 2.x in common configurations (models built on the meta
    device: no memory, no weights); activations are measured per run, so they are left out."""
    import lightning.pytorch as pl
    import torch

    from ldm.util import instantiate_from_config
    from lun.callbacks.ema import EMA
    from lun.config import merge_configs, to_container
    from lun.memory import memory_plan

    print(
        "| model | configuration | accelerator, without activations | of it optimizer state | host RAM: EMA |"
    )
    print("|---|---|---|---|---|")
    for name, config in (("SD 1.x", "v1-inference.yaml"), ("SD 2.x", "v2-inference.yaml")):
        model_config = to_container(merge_configs([ROOT / "configs/stable-diffusion" / config]))[
            "model"
        ]
        with torch.device("meta"):
            model = instantiate_from_config(model_config)
        for label, precision, eight_bit in CONFIGURATIONS:
            trainer = pl.Trainer(
                accelerator="cpu", precision=precision, callbacks=[EMA()], logger=False
            )
            plan = memory_plan(model, trainer, activations=0, host_budget=1)
            parts = {p.name: p.nbytes for p in plan.parts}
            optimizer = parts["optimizer state"]
            if eight_bit:
                saved = next(o for o in plan.options if o["name"] == "8-bit AdamW")["saves"]
                optimizer -= sum(saved.values())
            held = ("weights (trainable)", "gradients") + tuple(
                k for k in parts if k.startswith("frozen")
            )
            device = sum(parts[k] for k in held) + optimizer
            print(
                f"| {name} | {label} | {device / GB:.1f} GB | {optimizer / GB:.1f} GB | "
                f"{(parts['EMA'] + parts['EMA staging']) / GB:.1f} GB |"
            )


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--workdir", type=Path, help="checkpoint, images, runs (required to run)")
    parser.add_argument(
        "--plan-table", action="store_true", help="print the plan of SD 1.x/2.x configurations"
    )
    parser.add_argument("--width", type=int, help="UNet model_channels (default: SD's 320)")
    parser.add_argument("--steps", type=int, default=3, help="training steps before the resume")
    args = parser.parse_args(argv)
    if args.plan_table:
        plan_table()
        return
    if args.workdir is None:
        parser.error("--workdir is required to run the fine-tune")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a checkpoint after the second-last)")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "sd-v1-random.ckpt"
    if not checkpoint.exists():
        count = make_checkpoint(checkpoint, args.width)
        print(
            f"{checkpoint}: {count / 1e9:.3f} B parameters, {checkpoint.stat().st_size / GB:.2f} GB"
        )
    images = work / "images"
    if not images.exists():
        make_images(images)
    logs = work / "logs"
    marks = {"train": work / "marks-train.txt", "resume": work / "marks-resume.txt"}
    for path in marks.values():
        path.unlink(missing_ok=True)
    common = [
        "lightning.trainer.precision=32-true",
        "data.params.batch_size=1",
        "data.params.num_workers=0",
        "data.params.train.params.size=256",
        "~lightning.callbacks.image_logger",
        "lightning.callbacks.memory_phases.target=memory_figures.PhaseMarks",
    ]
    train = [
        "--base",
        "configs/stable-diffusion/v1-finetune.yaml",
        f"model.params.ckpt_path={checkpoint}",
        f"data.params.train.params.data_root={images}",
        f"lightning.trainer.max_steps={args.steps}",
        f"lightning.callbacks.modelcheckpoint.params.every_n_train_steps={args.steps - 1}",
        f"lightning.callbacks.memory_phases.params.path={marks['train']}",
        *_width(args.width),
        *common,
        "-l",
        str(logs),
        "-n",
        "memory-figures",
        "-t",
    ]
    trained, _ = run_sampled(train, marks["train"])
    trained_peaks = phase_peaks(trained, read_marks(marks["train"]))
    planned = plan_peaks(logs)
    run = next(logs.glob("*memory-figures*"))
    resume = [
        "--resume",
        str(run),
        # The run saved again when it ended (step `steps`): one more step after the restore.
        f"lightning.trainer.max_steps={args.steps + 1}",
        f"lightning.callbacks.memory_phases.params.path={marks['resume']}",
        "-t",
    ]
    resumed, _ = run_sampled(resume, marks["resume"])
    resumed_peaks = phase_peaks(resumed, read_marks(marks["resume"]))
    planned_resume = plan_peaks(logs)

    rows = [
        ("training", trained_peaks["training"], planned["training"]),
        ("saving", trained_peaks["saving"], planned["saving"]),
        ("resuming", resumed_peaks["startup"], planned_resume["resuming"]),
    ]
    print(f"\n{run.name}: peak RSS by phase (batch 1, 256 px, fp32, EMA)")
    print("| phase | measured | plan | measured / plan | vs training peak |")
    print("|---|---|---|---|---|")
    for phase, measured, plan in rows:
        print(
            f"| {phase} | {measured / GB:.2f} GB | {plan / GB:.2f} GB | {measured / plan:.2f} | "
            f"{measured / trained_peaks['training']:.2f}x |"
        )
    print(
        f"(startup of the first run, before its first step: {trained_peaks['startup'] / GB:.2f} GB)"
    )
    (work / "figures.json").write_text(
        json.dumps(
            {"measured": trained_peaks | {"resuming": resumed_peaks["startup"]}, "plan": planned}
        )
    )


if __name__ == "__main__":
    main()
