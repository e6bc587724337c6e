"""Teach a LoRA a concept the shapes demo model never saw, with and without prior preservation.

    python scripts/lora_concept.py --base-ckpt logs/<demo run>/checkpoints/last.ckpt

The base is a model trained by `make demo` (configs/demo/shapes.yaml): six colours, three shapes.
The concept is DreamBooth's setting (Ruiz et al. 2022) in miniature: a "sks circle" is a *pink*
circle - a colour no training image had - shown in `--instances` images; its class is "a circle".

1. draws the instance images (pink circles as make_shapes.py draws shapes), captioned
   "a sks circle";
2. trains two LoRAs through main.py (rank 8 on the attention projections, `--steps` steps,
   the text encoder frozen): DreamBooth data alone, and with prior preservation (the base
   model draws `--class-images` images for "a circle" first; prior_loss_weight 1);
3. scores the base and both LoRAs with eval_shapes.py's pixel reading: the concept (share of
   "a sks circle" images that are pink circles), the drift of the class (share of "a circle"
   images that are pink) and the 18 base prompts ("a red circle", ...: colour, shape, both).

With `--base-quantization none,int8,nf4,fp8` it trains instead the same LoRA (same seed, data
and steps; `--prior` for the prior-preservation one) on the base stored in each format
(`model.params.lora.base_quantization`, docs/quantized.md) and prints one row per format, each
score also as a ratio to the full-precision (`none`) row: QLoRA's claim (Dettmers et al. 2023)
that a LoRA on a 4-bit base learns what it learns on a 16-bit one, in miniature. Each LoRA is
scored with the base it was trained on: the run's checkpoint holds that base dequantized.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_shapes  # noqa: E402
from make_shapes import BACKGROUNDS, SHAPE_COLORS, SUPERSAMPLING, draw_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo" / "shapes.yaml"
# Far from every colour of make_shapes.py (RGB distance >= 130 to the nearest, purple) and from
# the backgrounds, so the pixel reading tells it apart as surely as the six.
NEW_COLOR = ("pink", (255, 110, 200))
PALETTE = {**SHAPE_COLORS, NEW_COLOR[0]: NEW_COLOR[1]}
INSTANCE_PROMPT, CLASS_PROMPT = "a sks circle", "a circle"
SAMPLING = {"sampler": "ddim", "steps": 25, "scale": 4.0}  # the demo's scoring settings


def draw_instances(folder: Path, count: int, size: int, seed: int) -> None:
    """`count` pink circles on the demo's plain backgrounds, placed and sized as make_shapes.py
    places its shapes."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        big = size * SUPERSAMPLING
        background = list(BACKGROUNDS.values())[i % len(BACKGROUNDS)]
        image = Image.new("RGB", (big, big), background)
        side = rng.uniform(0.5, 0.85) * big
        x0, y0 = rng.uniform(0, big - side), rng.uniform(0, big - side)
        draw_shape(
            ImageDraw.Draw(image), "circle", (x0, y0, x0 + side - 1, y0 + side - 1), NEW_COLOR[1]
        )
        image.resize((size, size), Image.Resampling.BOX).save(folder / f"{i:02d}.png")


def read_color(image: np.ndarray) -> str | None:
    """The shape's colour among the six and pink (eval_shapes' blob, nearest palette entry)."""
    pixels = np.asarray(image, dtype=np.float32)
    background = eval_shapes.background_color(pixels)
    distance = np.linalg.norm(pixels - background, axis=-1)
    blob = eval_shapes.largest_blob(distance > eval_shapes.FOREGROUND_DISTANCE)
    if blob.sum() < eval_shapes.MIN_AREA_FRACTION * blob.size:
        return None
    foreground = np.median(pixels[blob], axis=0)
    palette = np.array(list(PALETTE.values()), dtype=np.float32)
    return list(PALETTE)[int(np.argmin(np.linalg.norm(palette - foreground, axis=-1)))]


def sample(model, prompt: str, n: int, size: int, steps: int = SAMPLING["steps"]) -> np.ndarray:
    """`n` images of `prompt`, image i from seed i (as eval_shapes.py), as uint8 (n, H, W, 3)."""
    import torch

    from lun.generation import starting_noise

    noise = starting_noise(list(range(n)), model.latent_shape(size, size), model.device)
    with torch.no_grad():
        settings = {**SAMPLING, "steps": steps}
        images = model.sample([prompt] * n, height=size, width=size, noise=noise, **settings)
    return eval_shapes.to_uint8(images)


def score(ckpt: str, n: int, size: int, steps: int = SAMPLING["steps"]) -> dict:
    """The table's numbers for one checkpoint (its config found beside it, else the demo's)."""
    from lun.generation import load_model

    config = None if (Path(ckpt).parent.parent / "configs").is_dir() else str(CONFIG)
    model = load_model(
        argparse.Namespace(ckpt=ckpt, config=config, ema=None, unsafe_load=False, device="cpu")
    )
    concept = [
        read_color(x) == "pink" and eval_shapes.analyze(x).shape == "circle"
        for x in sample(model, INSTANCE_PROMPT, n, size, steps)
    ]
    drift = [read_color(x) == "pink" for x in sample(model, CLASS_PROMPT, n, size, steps)]
    base_args = argparse.Namespace(
        n=n // 2,
        template="{a} {color} {shape}",
        size=size,
        seed=0,
        batch_size=72,
        **{**SAMPLING, "steps": steps},
    )
    scores, _, _ = eval_shapes.evaluate(model, base_args)
    return {
        "concept": 100.0 * np.mean(concept),
        "drift": 100.0 * np.mean(drift),
        "colour": scores.percent(scores.color),
        "shape": scores.percent(scores.shape),
        "both": scores.percent(scores.both),
    }


def check_inputs(args) -> None:
    """--base-ckpt readable and --out a folder, in one line each (exit 2) before any training."""
    from lun.cli import check_output_folder
    from lun.generation import check_weights_file, one_line_errors

    with one_line_errors():
        check_weights_file(args.base_ckpt, "--base-ckpt", "a checkpoint file")
        check_output_folder(args.out, "--out")


def base_has_ema(path: str) -> bool:
    """Whether the base checkpoint has EMA weights (a demo run's has: they are what it samples
    with); a base without them is trained on from its raw weights."""
    from ldm.layout.ema import has_ema
    from ldm.safe_load import load_file_state, state_dict_of

    return has_ema(state_dict_of(load_file_state(path)))


def train_command(args, name: str, prior: bool, quantization: str = "none") -> list[str]:
    """main.py's command line for one LoRA, its frozen base stored as `quantization` says."""
    key = "data.params.train.params"
    lora = f"{{rank: 8, alpha: 8, targets: [attn], base_quantization: {quantization}}}"
    overrides = [
        f"model.params.ckpt_path={args.base_ckpt}",
        f"model.params.load_ema={args.base_has_ema}",  # the weights the demo samples with
        f"model.params.lora={lora}",
        "model.params.ucg_rate=0.0",  # one fixed prompt: the null caption stays the base's
        f"model.base_learning_rate={args.lr}",
        "model.params.scheduler_config.params.warmup_steps=20",
        f"lightning.trainer.max_steps={args.steps}",
        "lightning.callbacks.ema=null",
        "data.params.batch_size=8",
        "data.params.train.target=lun.data.dreambooth.DreamBooth",
        f"{key}.data_root={args.out / 'instance'}",
        f"{key}.instance_prompt={INSTANCE_PROMPT}",
    ]
    if prior:
        overrides += [
            f"{key}.class_data_root={args.out / 'class'}",
            f"{key}.class_prompt={CLASS_PROMPT}",
            f"{key}.num_class_images={args.class_images}",
            f"{key}.prior_loss_weight=1.0",
            f"{key}.class_model=${{model}}",
            f"{key}.sample_steps={SAMPLING['steps']}",
            f"{key}.sample_scale={SAMPLING['scale']}",
            f"{key}.sample_batch_size=32",
        ]
    command = [sys.executable, str(ROOT / "main.py"), "--base", str(CONFIG), *overrides]
    return command + ["-l", str(args.out / "logs"), "-n", name, "-t"]


def last_ckpt(name: str, returncode: int, stdout: str, stderr: str) -> str:
    """The run's last checkpoint, read from main.py's output (exit with its error if it failed)."""
    if returncode != 0:
        sys.exit(f"training {name} failed:\n{stderr[-3000:]}")
    (run,) = [
        line.split(": ", 1)[1] for line in stdout.splitlines() if line.startswith("run folder: ")
    ]
    return str(Path(run) / "checkpoints" / "last.ckpt")


def train(args, name: str, prior: bool) -> str:
    """One LoRA through main.py; returns its last checkpoint."""
    command = train_command(args, name, prior)
    print("$ " + " ".join(command[1:]), flush=True)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return last_ckpt(name, result.returncode, result.stdout, result.stderr)


def train_each(args, kinds: list[str]) -> dict[str, tuple[str, float]]:
    """The LoRA on each base format, `args.jobs` runs at a time: kind -> (last checkpoint, CPU
    seconds of its main.py). CPU time (user + system, `os.wait4`), not wall time: the runs share
    the machine with each other and with whatever else runs. Each run's output goes to
    `<out>/<name>.log`. With prior preservation the `none` run goes alone first: it draws the
    class images that the others then reuse (the same data for every format)."""
    waiting = list(kinds)
    running, done = {}, {}  # kind -> its process
    try:
        while waiting or running:
            alone = args.prior and "none" in waiting + list(running)
            while waiting and len(running) < (1 if alone else args.jobs):
                kind = waiting.pop(0)
                command = train_command(args, f"lora-{kind}", args.prior, quantization=kind)
                print("$ " + " ".join(command[1:]), flush=True)
                log = args.out / f"lora-{kind}.log"
                with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
                    running[kind] = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err)
            time.sleep(0.2)
            for kind, process in list(running.items()):
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid == 0:
                    continue  # still running
                del running[kind]
                process.returncode = os.waitstatus_to_exitcode(status)
                log = args.out / f"lora-{kind}.log"
                stdout, stderr = log.read_text(), log.with_suffix(".err").read_text()
                ckpt = last_ckpt(f"lora-{kind}", process.returncode, stdout, stderr)
                done[kind] = (ckpt, usage.ru_utime + usage.ru_stime)
    finally:  # a failed run stops the others
        for process in running.values():
            process.kill()
            process.wait()
    return done


QUANTIZATIONS = ("none", "int8", "nf4", "fp8")  # ldm.quantize.KINDS less "auto" (not one format)
COLUMNS = (  # (key, header, unit) of the comparison table
    ("concept", "'a sks circle': pink circles", "%"),
    ("drift", "'a circle': pink", "%"),
    ("colour", "base prompts: colour", "%"),
    ("shape", "shape", "%"),
    ("both", "both", "%"),
    ("train_s", "LoRA training: CPU", "s"),
)


def quantizations(text: str) -> list[str]:
    """`--base-quantization`'s formats, `none` first (the row the others are compared with)."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in QUANTIZATIONS]
    if wrong or not kinds:
        raise argparse.ArgumentTypeError(
            f"{wrong[0] if wrong else text!r} is not a base format; use a comma list of "
            f"{', '.join(QUANTIZATIONS)}"
        )
    return ["none"] + [k for k in dict.fromkeys(kinds) if k != "none"]


def cell(value: float, unit: str, reference: float | None) -> str:
    """`value` with its ratio to the full-precision row's (`-` where that one is 0)."""
    text = f"{value:.0f} {unit}" if unit == "%" else f"{value:.1f} {unit}"
    if reference is None:
        return text
    ratio = f"{value / reference:.2f}x" if reference else "-"
    return f"{text} ({ratio})"


def comparison_table(rows: dict[str, dict]) -> list[str]:
    """Markdown rows, one per base format, each value with its ratio to the `none` row's."""
    reference = rows.get("none")
    header = "| base | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [header, "|---" * (len(COLUMNS) + 1) + "|"]
    for kind, r in rows.items():
        ref = None if kind == "none" or reference is None else reference
        values = [cell(r[k], unit, None if ref is None else ref[k]) for k, _, unit in COLUMNS]
        lines.append(f"| {kind} | " + " | ".join(values) + " |")
    return lines


def compare_quantizations(args) -> None:
    """The same LoRA on the base in each format of `args.base_quantization`, scored alike."""
    import torch

    from ldm.quantize import unsupported

    for kind in args.base_quantization:  # before any run: one line for a format that cannot run
        why = unsupported(kind, torch.device("cpu"))
        if why:
            print(f"error: --base-quantization: {why}", file=sys.stderr)
            sys.exit(2)
    variant = "lora + prior preservation" if args.prior else "lora"
    print(
        f"{variant} on each base format: {args.instances} instance images, {args.steps} steps, "
        f"{args.n} images per concept prompt, {args.n // 2} per base prompt",
        flush=True,
    )
    runs = train_each(args, args.base_quantization)
    rows = {}
    for kind, (ckpt, cpu_s) in sorted(runs.items(), key=lambda r: QUANTIZATIONS.index(r[0])):
        rows[kind] = {**score(ckpt, args.n, args.size, args.sample_steps), "train_s": cpu_s}
        print(comparison_table(rows)[-1], flush=True)  # each row as soon as it is scored
    print("\n" + "\n".join(comparison_table(rows)), flush=True)
    if args.score_base:  # what the LoRAs started from
        r = score(args.base_ckpt, args.n, args.size, args.sample_steps)
        print("the base without a LoRA: " + ", ".join(f"{k} {v:.0f} %" for k, v in r.items()))


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--base-ckpt", required=True, help="a shapes demo checkpoint (make demo)")
    parser.add_argument("--out", type=Path, default=Path("outputs/lora-concept"))
    parser.add_argument(
        "--instances", type=int, default=5, help="instance images (DreamBooth: 3-5)"
    )
    parser.add_argument("--class-images", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, default=300, help="LoRA training steps (300: see README)"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--n", type=int, default=16, help="images per concept prompt (8 per base prompt)"
    )
    parser.add_argument("--size", type=int, default=16, help="image side of the demo")
    parser.add_argument(
        "--sample-steps", type=int, default=SAMPLING["steps"], help="DDIM steps of the scoring"
    )
    parser.add_argument(
        "--base-quantization",
        type=quantizations,
        help="compare the LoRA on the base in these formats, e.g. none,int8,nf4,fp8 "
        "(none is always trained: the row the others are compared with)",
    )
    parser.add_argument(
        "--score-base", action="store_true", help="with --base-quantization: score the base too"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="with --base-quantization: LoRA runs at a time"
    )
    parser.add_argument(
        "--prior", action="store_true", help="with --base-quantization: the prior-preservation LoRA"
    )
    args = parser.parse_args(argv)
    check_inputs(args)
    args.out = args.out.resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.base_has_ema = base_has_ema(args.base_ckpt)
    draw_instances(args.out / "instance", args.instances, args.size, seed=0)
    if args.base_quantization:
        compare_quantizations(args)
        return

    print(
        f"{args.instances} instance images, {args.steps} steps, {args.n} images per concept "
        f"prompt, {args.n // 2} per base prompt\n"
        "| model | 'a sks circle': pink circles | 'a circle': pink | base prompts: colour "
        "| shape | both |\n|---|---|---|---|---|---|",
        flush=True,
    )
    runs = (("lora", False), ("lora + prior preservation", True), ("base", None))
    for name, prior in runs:  # each row as soon as it is measured, the LoRAs' first
        ckpt = args.base_ckpt if prior is None else train(args, name.replace(" ", ""), prior)
        r = score(ckpt, args.n, args.size, args.sample_steps)
        print(
            f"| {name} | {r['concept']:.0f} % | {r['drift']:.0f} % | {r['colour']:.1f} % "
            f"| {r['shape']:.1f} % | {r['both']:.1f} % |",
            flush=True,
        )


if __name__ == "__main__":
    main()
