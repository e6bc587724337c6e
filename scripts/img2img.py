"""Turn an image into another: noise it to `--strength` and denoise it towards the prompt.

    python scripts/img2img.py --ckpt logs/<run>/checkpoints/last.ckpt --init-img sketch.png \\
        --prompt "a blue square on a white background" --strength 0.6
"""

import argparse

from lun.cli import HelpFormatter
from lun.generation_args import add_generation_args, check_generation_args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_generation_args(parser)
    parser.add_argument("--init-img", required=True, help="the starting image")
    parser.add_argument(
        "--strength",
        type=float,
        default=0.75,
        help="how much to change the image: int(steps * strength) of the steps are run, from "
        "that step's noise level (0 returns the image through the VAE, 1 ignores it)",
    )
    parser.set_defaults(outdir="outputs/img2img-samples")
    args = parser.parse_args(argv)
    check_generation_args(parser, args)
    if not 0.0 <= args.strength <= 1.0:
        parser.error("--strength must be in [0, 1]")
    from lun.generation import generate, one_line_errors, open_init_image  # torch: after parsing

    with one_line_errors():  # one line naming the file, exit 2 (1 for a failed write)
        init = open_init_image(args.init_img)  # before the model loads
        generate(args, init_image=init, extra_params={"Denoising strength": args.strength})


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    main()
