"""FID during training on the shapes demo, next to colour / shape accuracy: a PNG plot.

    python scripts/fid_demo.py --out /tmp/fid-demo --max-steps 600 --every 100

1. draws the demo's training set (scripts/make_shapes.py, 4000 images, 16 x 16), a held-out real
   set (1000 images, another seed) as the FID reference, and the 18 "a red circle" prompts;
2. trains the feature extractor (scripts/shapes_features.py) unless --features names one:
   ImageNet Inception weights cannot be downloaded here, and are not made for 16 px shapes;
3. trains configs/demo/shapes.yaml for --max-steps with the evaluation callback
   (lun.callbacks.evaluation) every --every steps;
4. scores the images each evaluation drew (saved with `save_images`) with scripts/eval_shapes.py's
   pixel analysis (colour / shape accuracy): no second sampling pass;
5. writes fid.png (FID and accuracy against the step) and fid.json next to it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from eval_shapes import Scores, analyze, prompts_to_score  # noqa: E402
from make_shapes import make_shapes  # noqa: E402


def run(args: list[str]) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=ROOT)


def train(out: Path, features: Path, args) -> Path:
    key = "lightning.callbacks"
    ev = f"{key}.evaluation.params"
    logs = out / "logs"
    earlier = set(logs.iterdir()) if logs.is_dir() else set()  # runs of earlier calls stay
    run(
        [
            "main.py",
            "--base",
            "configs/demo/shapes.yaml",
            *args.config,
            f"data.params.train.params.data_root={out / 'data'}",
            f"lightning.trainer.max_steps={args.max_steps}",
            f"{key}.evaluation.target=lun.callbacks.evaluation.Evaluation",
            f"{ev}.reference={out / 'reference' / 'images'}",
            f"{ev}.features={features}",
            f"{ev}.prompts={out / 'prompts.txt'}",
            f"{ev}.every_n_steps={args.every}",
            f"{ev}.num_eval_images={args.images}",
            f"{ev}.sampler={args.sampler}",
            f"{ev}.steps={args.sampling_steps}",
            f"{ev}.scale=4.0",
            f"{ev}.batch_size=54",
            f"{ev}.save_images=true",
            f"data.params.batch_size={args.batch_size}",
            f"{ev}.cache_dir={out / 'cache'}",
            "-l",
            str(logs),
            "-t",
        ]
    )
    (run_dir,) = set(logs.iterdir()) - earlier
    return run_dir


def fid_curve(run_dir: Path) -> dict[int, dict[str, float]]:
    """eval/* scalars by step from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    curve: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        if tag.startswith("eval/"):
            for event in events.Scalars(tag):
                curve.setdefault(event.step, {})[tag] = event.value
    return curve


def accuracy(folder: Path, prompts: list) -> dict[str, float]:
    """Colour / shape accuracy (scripts/eval_shapes.py's pixel analysis) of the images the
    evaluation saved: image i was drawn for prompt i mod 18."""
    import numpy as np
    from PIL import Image

    scores = Scores()
    for path in sorted(folder.glob("*.png")):
        _, color, shape = prompts[int(path.stem) % len(prompts)]
        scores.add(analyze(np.asarray(Image.open(path).convert("RGB"))), color, shape)
    return {"colour": scores.percent(scores.color), "shape": scores.percent(scores.shape)}


def plot(rows: list[dict], path: Path) -> None:
    """Two panels drawn with PIL (matplotlib is no dependency): FID, and accuracy in %."""
    width, height, pad = 900, 380, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    steps = [r["step"] for r in rows]
    x_max = max(steps)
    panels = [
        ("FID (shapes-classifier features) - lower is better", [("fid", (200, 30, 30))]),
        (
            "colour / shape accuracy % (pixel analysis) - higher is better",
            [("colour", (30, 70, 220)), ("shape", (30, 150, 50))],
        ),
    ]
    panel_w = (width - 3 * pad) // 2
    for p, (title, series) in enumerate(panels):
        left, top, right, bottom = pad + p * (panel_w + pad), pad, 0, height - pad
        right = left + panel_w
        values = [r[name] for r in rows for name, _ in series]
        y_max = 100.0 if p == 1 else max(values) * 1.1
        draw.rectangle([left, top, right, bottom], outline="black")
        draw.text((left, top - 40), title, fill="black")
        for k in range(5):  # y ticks
            value = y_max * k / 4
            y = bottom - (bottom - top) * k / 4
            draw.line([left - 4, y, left, y], fill="black")
            draw.text((left - 44, y - 6), f"{value:.3g}", fill="black")
        for step in steps:  # x ticks
            x = left + (right - left) * step / x_max
            draw.line([x, bottom, x, bottom + 4], fill="black")
            draw.text((x - 10, bottom + 8), str(step), fill="black")
        draw.text(((left + right) // 2 - 30, bottom + 24), "training step", fill="black")
        for n, (name, colour) in enumerate(series):
            points = [
                (
                    left + (right - left) * r["step"] / x_max,
                    bottom - (bottom - top) * r[name] / y_max,
                )
                for r in rows
            ]
            draw.line(points, fill=colour, width=3)
            for x, y in points:
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
            draw.text((right - 80, top + 10 + 16 * n), name, fill=colour)
    image.save(path)


def check_inputs(args) -> None:
    """What the flags name, in one line each (exit 2) before data is drawn or anything trains:
    a --features file that is not there would otherwise be trained anew and written there."""
    from lun.cli import check_output_folder
    from lun.generation import check_weights_file, one_line_errors

    with one_line_errors():
        check_output_folder(args.out, "--out")
        if args.features:
            missing = " (leave --features out to train one)"
            check_weights_file(args.features, "--features", "a SmallCNN file", missing)
        if args.resume and not (Path(args.resume) / "checkpoints").is_dir():
            raise FileNotFoundError(f"--resume {args.resume}: not a run folder (no checkpoints/)")
        for overlay in args.config:
            if not Path(overlay).is_file():
                raise FileNotFoundError(f"--config {overlay}: no such file")


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", required=True, help="working folder (data, run, plot)")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--images", type=int, default=54, help="images per evaluation")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="an overlay on configs/demo/shapes.yaml, e.g. configs/demo/shapes-flow.yaml",
    )
    parser.add_argument(
        "--sampler", default="ddim", help="the evaluation's sampler (euler for a flow model)"
    )
    parser.add_argument("--sampling-steps", type=int, default=10, help="sampling steps per image")
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size")
    parser.add_argument("--features", help="a SmallCNN file (default: train one)")
    parser.add_argument("--resume", help="a run folder of this script: train on to --max-steps")
    args = parser.parse_args(argv)
    check_inputs(args)
    out = Path(args.out).resolve()
    if not (out / "data").is_dir():
        make_shapes(out / "data", 4000, 16, seed=0)
        make_shapes(out / "reference", 1000, 16, seed=1)
    (out / "prompts.txt").write_text(
        "\n".join(p for p, _, _ in prompts_to_score("{a} {color} {shape}"))
    )
    features = Path(args.features) if args.features else out / "shapes-features.safetensors"
    if not features.is_file():
        run(["scripts/shapes_features.py", "--out", str(features)])
    if args.resume:  # go on training a run of this script, to --max-steps
        run_dir = Path(args.resume)
        every = f"lightning.callbacks.evaluation.params.every_n_steps={args.every}"
        steps = f"lightning.trainer.max_steps={args.max_steps}"
        run(["main.py", "--resume", str(run_dir), steps, every, "-t"])
    else:
        run_dir = train(out, features, args)
    curve = fid_curve(run_dir)
    rows = []
    prompts = prompts_to_score("{a} {color} {shape}")
    for step, metrics in sorted(curve.items()):
        if "eval/fid" not in metrics:
            continue
        folder = run_dir / "images" / "eval" / f"gs-{step:06d}"
        rows.append({"step": step, "fid": metrics["eval/fid"], **accuracy(folder, prompts)})
        rows[-1].update(kid=metrics["eval/kid"], eval_seconds=metrics["eval/seconds"])
        print(rows[-1], flush=True)
    (out / "fid.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "fid.png")
    print(f"wrote {out / 'fid.png'} and {out / 'fid.json'}")


if __name__ == "__main__":
    main()
