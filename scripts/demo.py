"""`make demo`: train a small text-to-image model (CPU: about 10 minutes), then draw with it.

    python scripts/demo.py                  # data -> train -> sample grid -> scores
    python scripts/demo.py --max-steps 500  # a shorter (and worse) run
    python scripts/demo.py --config configs/demo/shapes-flow.yaml   # rectified flow (docs/flow.md)
    python scripts/demo.py --config configs/demo/shapes-mmdit.yaml  # a small MMDiT, with flow
    python scripts/demo.py model.base_learning_rate=2.0e-4  # any main.py override (key=value)

1. makes the synthetic shapes data set with scripts/make_shapes.py, unless it is there;
2. trains configs/demo/shapes.yaml (and the --config overlays on it) with main.py (a run folder under logs/);
3. draws a sample grid for a fixed prompt list with scripts/txt2img.py;
4. scores colour and shape on every (colour, shape) prompt with scripts/eval_shapes.py;
5. prints where the grid is.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo" / "shapes.yaml"
IMAGE_SIZE = 16  # must match configs/demo/shapes.yaml (data.params.train.params.size)
# Every colour and shape once, with and without a background, for the grid (one row each).
PROMPTS = (
    "a red circle",
    "a blue square",
    "a yellow triangle",
    "a green square on a white background",
    "a purple circle on a black background",
    "an orange triangle on a gray background",
)
# Sampling settings of the grid and the scores (chosen on the demo's own runs).
ENLARGE = 8  # the grid is also saved this many times larger, pixels kept sharp
SAMPLING = ["--sampler", "ddim", "--steps", "25", "--scale", "4"]
# A rectified-flow model is drawn with flow Euler (ldm/flow.py), the same steps and guidance.
FLOW_SAMPLING = ["--sampler", "euler", "--steps", "25", "--scale", "4"]


def sampling_for(configs: list[str]) -> list[str]:
    """The sampler flags for the model of the merged `configs`: flow Euler for a flow model
    (`parameterization: flow`), DDIM for eps / v."""
    from omegaconf import OmegaConf

    from lun.config import merge_configs

    merged = merge_configs([ROOT / config for config in configs])
    objective = OmegaConf.select(merged, "model.params.parameterization", default="eps")
    return FLOW_SAMPLING if objective == "flow" else SAMPLING


def idle_cores() -> int:
    """CPU cores not busy right now (cores minus the 1-minute load average), at least 1.

    PyTorch runs each CPU op on all its threads and waits for the slowest: on a shared machine,
    a thread that waits for a busy core stalls every op. Measured on a 2-core box with a load
    of 3-4: 2 threads trained this demo 2-10x slower than 1 thread.
    """
    cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def device_overrides(cuda_available: bool) -> list[str]:
    """The trainer's accelerator and precision for this machine: one GPU in bf16-mixed where
    there is one (tensor cores; bf16 needs no loss scaling), else the CPU in fp32 (CPUs without
    AVX512-bf16/AMX run bf16 autocast ~10x slower). On a GPU two loader workers decode the next
    batches while the step runs (the config's 0 keeps a CPU run's cores for the step; on the
    H100 the demo waited 9.9 % of its time for data decoded in the step's own process)."""
    if cuda_available:
        return [
            "lightning.trainer.accelerator=gpu",
            "lightning.trainer.precision=bf16-mixed",
            "data.params.num_workers=2",
        ]
    return ["lightning.trainer.accelerator=cpu", "lightning.trainer.precision=32"]


def cuda_available() -> bool:
    import torch  # here, not at the top: `--help` stays fast

    return torch.cuda.is_available()


def run(*args: str, capture_run_folder: bool = False) -> str:
    """Run `python ARGS` from the project root, its output going to ours; stop if it fails.

    With `capture_run_folder`, returns the folder main.py reports ("run folder: ...").
    """
    print("$ python " + " ".join(args), flush=True)
    process = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    found = ""
    for line in process.stdout:
        print(line, end="", flush=True)
        if capture_run_folder and line.startswith("run folder: "):
            found = line.removeprefix("run folder: ").strip()
    if process.wait() != 0:
        sys.exit(f"demo: `python {' '.join(args)}` failed (exit status {process.returncode})")
    if capture_run_folder and not found:
        sys.exit(f"demo: `python {' '.join(args)}` named no run folder")
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="data/shapes", help="data set folder (made if missing)")
    parser.add_argument("--n-images", type=int, default=4000, help="images to make")
    parser.add_argument("--logdir", default="logs", help="parent folder of the run folder")
    parser.add_argument("--max-steps", type=int, help="training steps (default: the config's)")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="an overlay on configs/demo/shapes.yaml, e.g. configs/demo/shapes-flow.yaml "
        "(rectified flow) or configs/demo/shapes-mmdit.yaml (an MMDiT); repeatable",
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads (default: $OMP_NUM_THREADS, else the idle cores)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="config overrides passed to main.py after the demo's own (so they win)",
    )
    args = parser.parse_args(argv)
    for override in args.overrides:
        if "=" not in override or override.startswith("="):
            parser.error(f"{override!r}: an override is key.path=value")
    for overlay in args.config:
        if not (ROOT / overlay).is_file():
            parser.error(f"--config {overlay}: no such file (paths are from {ROOT})")
    from lun.cli import check_output_folder

    try:  # a file where a folder goes: one line now, not a failed step after minutes
        check_output_folder(ROOT / args.data, "--data")
        check_output_folder(ROOT / args.logdir, "--logdir")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.threads or "OMP_NUM_THREADS" not in os.environ:
        # Read by PyTorch in every step below (each is a new process).
        os.environ["OMP_NUM_THREADS"] = str(args.threads or idle_cores())
    print(f"using {os.environ['OMP_NUM_THREADS']} CPU thread(s) (--threads to change)")

    data = Path(args.data)
    if (ROOT / data / "images").is_dir():
        print(f"using the data set in {data} (delete it to make a new one)")
    else:
        size, n = str(IMAGE_SIZE), str(args.n_images)
        run("scripts/make_shapes.py", "--out", str(data), "--n", n, "--size", size, "--seed", "0")

    overrides = [f"data.params.train.params.data_root={data}", *device_overrides(cuda_available())]
    if args.max_steps is not None:
        overrides.append(f"lightning.trainer.max_steps={args.max_steps}")
    overrides += args.overrides
    configs = [str(CONFIG.relative_to(ROOT)), *args.config]
    name = "demo-" + Path(configs[-1]).stem  # demo-shapes, demo-shapes-flow, ...
    train = ["main.py", "--base", *configs, *overrides, "-n", name, "-l", args.logdir]
    run_folder = ROOT / run(*train, "-t", capture_run_folder=True)
    ckpt = str(run_folder / "checkpoints" / "last.ckpt")

    prompts = run_folder / "demo-prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    samples = run_folder / "samples"
    sampling = sampling_for(configs)
    generate = ["--ckpt", ckpt, "--seed", "0", *sampling]
    grid_args = ["--from-file", str(prompts), "--n_samples", "6", "--outdir", str(samples)]
    run("scripts/txt2img.py", *generate, *grid_args)
    scored = ["--n", "8", "--verbose", "--grid", str(run_folder / "eval.png")]
    run("scripts/eval_shapes.py", *generate, *scored)

    (grid,) = samples.glob("grid-*.png")
    enlarged = grid.with_name(f"{grid.stem}-x{ENLARGE}.png")
    with Image.open(grid) as image:  # 16-pixel images are small on a screen
        image.resize(
            (image.width * ENLARGE, image.height * ENLARGE), Image.Resampling.NEAREST
        ).save(enlarged)
    print(f"\nsample grid (one row per prompt of {prompts}):\n  {grid}\n  {enlarged} (enlarged)")
    print(
        f"more images: python scripts/txt2img.py --ckpt {ckpt} --prompt 'a blue circle' "
        f"--n_samples 8 {' '.join(sampling)}"
    )


if __name__ == "__main__":
    main()
