"""FID, KID and CLIP score of checkpoints, offline: a table on the screen and a JSON file.

    python scripts/evaluate.py logs/<run>/checkpoints/step-*.ckpt \\
        --prompts prompts.txt --reference /data/real-images \\
        --features pt_inception-2015-12-05-6726825d.pth --clip /models/clip-vit-large-patch14 \\
        --num-images 1000 --out eval.json
    # an original SD checkpoint or a diffusers folder: name its config
    python scripts/evaluate.py v1-5-pruned.safetensors --base configs/stable-diffusion/v1-inference.yaml ...

The metrics are the evaluation callback's (lun.callbacks.evaluation): FID (Heusel et al. 2017)
and KID (Binkowski et al. 2018) on the features of `--features` against the real images of
`--reference` (computed once, cached under a content hash), CLIP score (Hessel et al. 2021)
with `--clip`. Image i uses seed `--seed` + i and prompt i (cycled), so checkpoints are compared
on the same prompts and starting noise. Class-conditional models (DiT) take `--classes`.
Nothing is downloaded: a missing file is one line naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The heavy modules (torch, the models) are imported in the functions: --help answers at once.


def parse_args(argv=None) -> argparse.Namespace:
    from lun.cli import HelpFormatter, seed
    from lun.generation_args import SAMPLER_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("ckpts", nargs="+", help=".ckpt / .safetensors files or diffusers folders")
    parser.add_argument(
        "--base", nargs="*", default=[], help="model config(s), merged (default: the run's)"
    )
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompts", help="prompt file, one per line, cycled to --num-images")
    inputs.add_argument("--classes", type=int, nargs="+", help="class ids instead (DiT)")
    parser.add_argument("--reference", required=True, help="folder of real images")
    parser.add_argument("--features", required=True, help="feature-extractor weights file")
    parser.add_argument("--clip", help="local CLIP model folder: also the CLIP score")
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--num-images", type=int, default=1000, help="images drawn per checkpoint")
    parser.add_argument("--sampler", choices=list(SAMPLER_NAMES), default="ddim", help="sampler")
    parser.add_argument("--steps", type=int, default=25, help="sampling steps")
    parser.add_argument("--scale", type=float, default=5.0, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=seed, default=0, help="image i uses seed + i")
    parser.add_argument("--size", type=int, help="image side (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per sampling batch")
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EMA weights (default: when the checkpoint has them)",
    )
    parser.add_argument("--feature-size", type=int, default=299, help="Inception input side")
    parser.add_argument("--reference-images", type=int, help="use at most this many real images")
    parser.add_argument("--kid-subsets", type=int, default=100, help="KID: subsets drawn")
    parser.add_argument("--kid-subset-size", type=int, default=1000, help="KID: subset size")
    parser.add_argument("--cache-dir", help="reference cache (default ~/.cache/lun/eval)")
    parser.add_argument("--device", help="default: cuda, else mps, else cpu")
    parser.add_argument(
        "--unsafe-load", action="store_true", help="allow pickled code (trusted files)"
    )
    return parser.parse_args(argv)


def check_inputs(args) -> list:
    """Every file named, before anything slow; returns the prompts or class ids."""
    from ldm.layout import family
    from ldm.safe_load import check_readable
    from lun.callbacks.evaluation import read_prompt_file
    from lun.cli import check_output_file, check_output_folder, naming
    from lun.config import merge_configs, to_container
    from lun.eval.clip_score import check_clip_folder
    from lun.eval.features import check_features_file
    from lun.generation import check_model_file, check_text_file

    if args.out:  # written after the whole evaluation: a wrong path is said now
        check_output_file(args.out, "--out")
    if args.cache_dir:
        check_output_folder(args.cache_dir, "--cache-dir")
    for config in args.base:
        check_text_file(Path(config), "--base")
    if args.prompts and Path(args.prompts).exists():
        check_text_file(Path(args.prompts), "--prompts")  # a folder, a binary file
    inputs = read_prompt_file(args.prompts) if args.prompts else list(args.classes)
    check_features_file(args.features, "--features")
    with naming("--features", args.features):
        check_readable(args.features)  # read after the first model loads
    if args.clip is not None:
        check_clip_folder(args.clip, "--clip")
        if args.classes:
            raise ValueError("--clip: the CLIP score needs --prompts, not --classes")
    if not Path(args.reference).is_dir():
        raise ValueError(f"--reference={args.reference}: no such folder of real images")
    for ckpt in args.ckpts:
        if not Path(ckpt).exists():
            raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    expected = None
    if args.base:  # the family of the model the config builds (on the meta device)
        expected = family.model_family(to_container(merge_configs(args.base))["model"])
    for ckpt in args.ckpts:  # each file's family, from its keys
        check_model_file(ckpt, expected, "ckpt", args.unsafe_load)
    if args.num_images < 2:
        raise ValueError(f"--num-images={args.num_images}: FID needs at least 2 images")
    return inputs


def draw_and_score(model, inputs: list, extractor, scorer, args):
    """Features (N, D) and CLIP scores (N,) or None of --num-images images of `model`."""
    import torch

    with torch.no_grad():
        return _draw_and_score(model, inputs, extractor, scorer, args)


def _draw_and_score(model, inputs: list, extractor, scorer, args):
    import numpy as np
    import torch

    from lun.generation import starting_noise

    size = args.size or model.default_image_size
    latent_shape = model.latent_shape(size, size)
    features, clip = [], []
    for start in range(0, args.num_images, args.batch_size):
        index = range(start, min(start + args.batch_size, args.num_images))
        batch = [inputs[i % len(inputs)] for i in index]
        seeds = [args.seed + i for i in index]
        images = model.sample(
            batch,
            height=size,
            width=size,
            sampler=args.sampler,
            steps=args.steps,
            scale=args.scale,
            generator=torch.Generator(model.device).manual_seed(seeds[0]),
            noise=starting_noise(seeds, latent_shape, model.device),
        )
        features.append(extractor(images).cpu().numpy())
        if scorer is not None:
            clip.append(scorer(images, batch).cpu().numpy())
    return np.concatenate(features), np.concatenate(clip) if scorer is not None else None


def table(rows: list[dict]) -> str:
    header = (
        f"{'checkpoint':40s} {'images':>6s} {'FID':>9s} {'KID':>10s} {'KID std':>9s} {'CLIP':>7s}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        clip = f"{r['clip_score']:7.2f}" if "clip_score" in r else f"{'-':>7s}"
        name = r["checkpoint"] if len(r["checkpoint"]) <= 40 else "..." + r["checkpoint"][-37:]
        lines.append(
            f"{name:40s} {int(r['num_images']):6d} {r['fid']:9.3f} {r['kid']:10.5f} "
            f"{r['kid_std']:9.5f} {clip}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    from lun.generation import load_model, one_line_errors, write_text_atomically

    with one_line_errors():
        inputs = check_inputs(args)
        from lun.eval.clip_score import CLIPScorer
        from lun.eval.features import load_features
        from lun.eval.fid import fid_kid
        from lun.eval.reference import reference_features

        rows = []
        for ckpt in args.ckpts:
            started = time.perf_counter()
            model = load_model(
                argparse.Namespace(
                    ckpt=ckpt,
                    config=args.base or None,
                    ema=args.ema,
                    unsafe_load=args.unsafe_load,
                    device=args.device,
                ),
                flag="ckpt",
            )
            if not rows:  # the extractor and the reference, on the model's device
                extractor = load_features(args.features, args.feature_size).to(model.device)
                scorer = CLIPScorer(args.clip).to(model.device) if args.clip else None
                size = args.size or model.default_image_size
                reference, path, cached = reference_features(
                    args.reference, extractor, size, args.cache_dir, args.reference_images
                )
                print(
                    f"reference: {len(reference)} images ({'cached' if cached else 'computed'}: {path})"
                )
            features, clip = draw_and_score(model, inputs, extractor, scorer, args)
            row = {"checkpoint": str(ckpt)}
            row.update(
                fid_kid(reference, features, args.kid_subsets, args.kid_subset_size, args.seed)
            )
            if clip is not None:
                row["clip_score"] = float(clip.mean())
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            del model
        print(table(rows))
        if args.out:
            settings = {k: v for k, v in vars(args).items() if k not in ("ckpts", "out")}
            settings["features_identity"] = extractor.identity
            settings["reference_count"] = len(reference)
            results = json.dumps({"settings": settings, "results": rows}, indent=1)
            write_text_atomically(Path(args.out), results)  # an earlier file: whole, or replaced
            print(f"wrote {args.out}")


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    main()
