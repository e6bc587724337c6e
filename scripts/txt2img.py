"""Generate images from a prompt with a trained (or original SD) checkpoint.

    python scripts/txt2img.py --ckpt logs/<run>/checkpoints/last.ckpt --prompt "a red circle" \\
        --sampler dpmpp_2m --karras --steps 20 --scale 7 --n-samples 4
    python scripts/txt2img.py --config configs/stable-diffusion/v1-inference.yaml \\
        --ckpt v1-5-pruned-emaonly.safetensors --prompt "a photo of an astronaut"
"""

import argparse

from lun.cli import HelpFormatter
from lun.generation_args import add_generation_args, check_generation_args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_generation_args(parser)
    args = parser.parse_args(argv)
    check_generation_args(parser, args)
    from lun.generation import generate, one_line_errors  # torch: after parsing

    with one_line_errors():  # one line naming the file, exit 2 (1 for a failed write)
        generate(args)


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    main()
