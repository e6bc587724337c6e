"""The flags txt2img and img2img share, apart from `lun.generation` so that `--help` and a
mistyped flag answer without importing torch."""

import argparse

from lun.cli import finite_float, old_spelling, positive_int, seed

SAMPLER_NAMES = {
    "ddim": "DDIM",
    "plms": "PLMS",
    "euler": "Euler",
    "euler_a": "Euler a",
    "heun": "Heun",
    "dpmpp_2m": "DPM++ 2M",
    "ddpm_learned": "DDPM",  # learned variances (DiT learn_sigma models)
}
DTYPE_NAMES = ("fp32", "bf16", "fp16")  # lun.generation.DTYPES


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (Flux's guidance input: the conditioner refuses a negative one)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The flags txt2img and img2img share (names as in the original SD scripts)."""
    parser.add_argument(
        "--prompt", default="a painting of a virus monster playing guitar", help="what to draw"
    )
    parser.add_argument("--from-file", help="one prompt per line (overrides --prompt)")
    parser.add_argument(
        "--class",
        dest="classes",
        nargs="+",
        metavar="CLASS",
        help="classes to draw instead of prompts, for a class-conditional model (DiT): ids "
        "(ImageNet: 207 = golden retriever) or names of the training config's class folders; "
        "guidance is against the null class",
    )
    parser.add_argument("--negative-prompt", default="", help="what the image should not show")
    parser.add_argument("--outdir", default="outputs/txt2img-samples", help="output folder")
    parser.add_argument("--steps", type=positive_int, default=50, help="sampling steps")
    old_spelling(parser, "--ddim_steps", "steps", type=positive_int)
    parser.add_argument(
        "--sampler",
        choices=list(SAMPLER_NAMES),
        default=None,
        help="sampler (default: ddim; euler for a flow model - SD3, Flux - which samples with "
        "euler or heun)",
    )
    parser.add_argument("--karras", action="store_true", help="Karras sigmas (sigma samplers)")
    parser.add_argument("--eta", type=finite_float, default=0.0, help="DDIM eta")
    old_spelling(parser, "--ddim_eta", "eta", type=finite_float)
    parser.add_argument(
        "--scale",
        type=finite_float,
        default=None,
        help="classifier-free guidance scale; 1 runs no unconditional pass; Flux, which is "
        "guidance-distilled, defaults to 1 (default: 7.5)",
    )
    parser.add_argument(
        "--guidance",
        type=non_negative_float,
        default=None,
        help="Flux dev's distilled guidance, the scale fed to the model instead of CFG "
        "(default: the config's, 3.5)",
    )
    parser.add_argument(
        "--n-samples", type=positive_int, default=1, help="images per prompt per iteration (batch)"
    )
    old_spelling(parser, "--n_samples", "n_samples", type=positive_int)
    parser.add_argument("--n-iter", type=positive_int, default=1, help="iterations")
    old_spelling(parser, "--n_iter", "n_iter", type=positive_int)
    parser.add_argument(
        "--H", type=positive_int, default=None, help="height in pixels (default: the model's)"
    )
    parser.add_argument(
        "--W", type=positive_int, default=None, help="width in pixels (default: the model's)"
    )
    parser.add_argument(
        "--seed", type=seed, default=42, help="0 to 2**32 - 1; image i of the run uses seed + i"
    )
    parser.add_argument(
        "--fixed-code", action="store_true", help="same starting noise in every iteration"
    )
    old_spelling(parser, "--fixed_code", "fixed_code", action="store_true")
    parser.add_argument("--config", help="model config (default: the run folder's saved config)")
    parser.add_argument(
        "--ckpt",
        required=True,
        help=".ckpt or .safetensors (ours or an original SD one), or a diffusers folder",
    )
    parser.add_argument(
        "--precision", choices=["full", "autocast"], default="full", help="sampling precision"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="autocast dtype, with --precision autocast (default: bf16)",
    )
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use EMA weights (default: when the checkpoint has them)",
    )
    parser.add_argument(
        "--vae",
        help="VAE file replacing the checkpoint's first stage: one trained here (a run's .ckpt or "
        "swap_vae.py's file), an original SD VAE .ckpt/.safetensors or a diffusers AutoencoderKL "
        ".safetensors",
    )
    parser.add_argument("--skip-grid", action="store_true", help="no grid image of the samples")
    old_spelling(parser, "--skip_grid", "skip_grid", action="store_true")
    parser.add_argument("--device", default=None, help="default: cuda, else mps, else cpu")
    parser.add_argument(
        "--unsafe-load",
        action="store_true",
        help="allow pickled code in a .ckpt (only for files you trust)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:WEIGHT]",
        help="merge a LoRA / LoCon / DoRA file (kohya or diffusers format) at WEIGHT (default "
        "1) before sampling; repeatable",
    )


def check_generation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that only mean something together: `--dtype fp16` alone sampled in float32, silently."""
    if args.dtype is not None and args.precision != "autocast":
        parser.error(f"--dtype {args.dtype} applies with --precision autocast; give both")
    args.dtype = args.dtype or "bf16"
