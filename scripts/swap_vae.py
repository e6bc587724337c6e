"""Put a trained VAE into a Stable Diffusion checkpoint, or write it alone.

    python scripts/swap_vae.py --vae logs/<vae run>/checkpoints/last.ckpt \\
        --ckpt v1-5-pruned.safetensors --out v1-5-myvae.safetensors
    python scripts/swap_vae.py --vae logs/<vae run>/checkpoints/last.ckpt --out myvae.safetensors

The VAE may be a checkpoint of `configs/autoencoder/` training (`encoder.*`, `decoder.*`, ...),
a standalone VAE file, or a full SD checkpoint (`first_stage_model.*`); `--ema` takes the EMA
weights of a training checkpoint. With `--ckpt` every `first_stage_model.*` weight of the
diffusion checkpoint is replaced (same names and shapes, or the script stops naming the first
mismatch); without it the VAE alone is written with the original bare names, the layout
AUTOMATIC1111 and ComfyUI load as a VAE file (and diffusers' `AutoencoderKL.from_single_file`).
Output is `.safetensors`. `--to-diffusers DIR` also writes a diffusers `AutoencoderKL` folder
(config.json + diffusion_pytorch_model.safetensors, for `AutoencoderKL.from_pretrained(DIR)`):

    python scripts/swap_vae.py --vae logs/<vae run>/checkpoints/last.ckpt --ema --to-diffusers myvae

An SD 3/3.5 VAE (16 channels, no quant_conv) needs its latent geometry named for the diffusers
config: `--scaling-factor 1.5305 --shift-factor 0.0609`.
"""

from __future__ import annotations  # torch is imported after parsing: --help answers at once

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lun.cli import HelpFormatter, check_output_file, check_output_folder

if TYPE_CHECKING:
    import torch


def vae_weights(path: str, ema: bool = False, unsafe: bool = False) -> dict[str, torch.Tensor]:
    """The VAE's weights under their bare original names, from any of the accepted files."""
    from ldm.checkpoint import check_family
    from ldm.layout import family, original
    from ldm.layout.ema import EMA_PREFIX, ema_key
    from ldm.safe_load import load_file_state, state_dict_of

    state = state_dict_of(load_file_state(path, unsafe=unsafe))
    found = family.model_family(state)
    if found != family.VAE and not original.has_first_stage(state):
        expected = f"a VAE, or a model checkpoint holding one ({original.FIRST_STAGE_PREFIX}*)"
        check_family(path, found, family.VAE, "--vae", expected)
    if original.has_first_stage(state):  # its EMA shadows too (`model_ema.*` lose no prefix)
        state = {k.removeprefix(original.FIRST_STAGE_PREFIX): v for k, v in state.items()}
    vae = {k: v for k, v in state.items() if k.startswith(original.VAE_PARTS)}
    if not vae:
        raise ValueError(f"{path}: holds no VAE weights (encoder.*, decoder.*, ...)")
    if ema:
        shadows = {k: state[ema_key(k)] for k in vae if ema_key(k) in state}
        if not shadows:
            raise ValueError(f"{path}: --ema asked, but it has no {EMA_PREFIX}* weights")
        vae.update(shadows)  # frozen parts (train_decoder_only) keep their raw weights
    return vae


def swap(diffusion: dict, vae: dict, what: str) -> dict:
    """`diffusion` with its `first_stage_model.*` replaced by `vae` (names and shapes must match)."""
    from ldm.layout import family
    from ldm.layout.original import first_stage_key, first_stage_state, has_first_stage

    own = set(first_stage_state(diffusion)) if has_first_stage(diffusion) else set()
    found, expected = family.vae_kind(vae), family.vae_kind(own)
    if found != expected and None not in (found, expected):
        raise ValueError(
            f"--vae holds {found}, but --ckpt {what} holds {expected}; give "
            f"{family.VAE_KIND_FILES[expected]} as --vae"
        )
    if own != set(vae):
        missing, extra = sorted(own - set(vae)), sorted(set(vae) - own)
        raise ValueError(f"{what}: VAE names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    out = dict(diffusion)
    for name, tensor in vae.items():
        old = diffusion[first_stage_key(name)]
        if old.shape != tensor.shape:
            raise ValueError(
                f"{what}: {name} is {tuple(tensor.shape)}, expected {tuple(old.shape)}"
            )
        out[first_stage_key(name)] = tensor.to(old.dtype)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--vae", required=True, help="trained VAE (.ckpt / .safetensors)")
    parser.add_argument("--ckpt", help="SD checkpoint to put it into (omit: write the VAE alone)")
    parser.add_argument("--out", help="output .safetensors")
    parser.add_argument(
        "--to-diffusers", metavar="DIR", help="write a diffusers AutoencoderKL folder"
    )
    parser.add_argument(
        "--scaling-factor",
        type=float,
        help="diffusers config (default 0.18215 for a 4-channel VAE; SDXL: 0.13025; SD3: 1.5305)",
    )
    parser.add_argument(
        "--shift-factor", type=float, default=0.0, help="diffusers config (SD3: 0.0609)"
    )
    parser.add_argument("--size", type=int, default=512, help="diffusers config's sample_size")
    parser.add_argument("--ema", action="store_true", help="take the VAE's EMA weights")
    parser.add_argument("--half", action="store_true", help="write float16 weights")
    parser.add_argument("--unsafe-load", action="store_true", help="trust pickled code")
    opt = parser.parse_args(argv)
    if not opt.out and not opt.to_diffusers:
        parser.error("give --out FILE, --to-diffusers DIR, or both")
    try:  # the outputs first: a mistyped name is one line before anything is read
        if opt.out:
            check_output_file(opt.out, "--out", (".safetensors",))
        if opt.to_diffusers:
            check_output_folder(opt.to_diffusers, "--to-diffusers")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import pickle

    import torch

    from ldm.checkpoint import check_family, save_safetensors
    from ldm.layout import family
    from ldm.safe_load import load_file_state, state_dict_of
    from lun.cli import check_input_file, naming
    from lun.generation import one_line_errors, replaced_folder, writing

    try:
        for flag, path in (("--vae", opt.vae), ("--ckpt", opt.ckpt)):
            if path:
                check_input_file(path, flag)
        with naming("--vae", opt.vae):
            vae = vae_weights(opt.vae, opt.ema, opt.unsafe_load)
        if opt.ckpt:
            with naming("--ckpt", opt.ckpt):
                diffusion = state_dict_of(load_file_state(opt.ckpt, opt.unsafe_load))
            found = family.model_family(diffusion)
            if found in (family.VAE, family.LORA):
                expected = "a diffusion model checkpoint (first_stage_model.*)"
                check_family(opt.ckpt, found, "model", "--ckpt", expected)
            state = swap(diffusion, vae, opt.ckpt)
        else:
            state = vae
        scaling_factor = opt.scaling_factor
        if opt.to_diffusers and scaling_factor is None:
            scaling_factor = default_scaling_factor(vae, opt.vae)
    except (OSError, ValueError, KeyError, pickle.UnpicklingError) as err:
        # UnpicklingError: ldm.safe_load's refusal of a file holding code
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    dtype = torch.float16 if opt.half else None
    try:
        with one_line_errors():  # a failed write: the system's words and the path, exit 1
            if opt.out:
                with writing(opt.out):
                    save_safetensors(state, opt.out, dtype=dtype)
                print(f"wrote {opt.out} ({len(vae)} VAE tensors)")
            if opt.to_diffusers:
                with writing(opt.to_diffusers), replaced_folder(opt.to_diffusers) as folder:
                    write_diffusers(vae, folder, dtype, scaling_factor, opt.size, opt.shift_factor)
                print(f"wrote diffusers AutoencoderKL to {opt.to_diffusers}")
    except SystemExit as stop:
        return stop.code
    return 0


def default_scaling_factor(vae: dict, path: str) -> float:
    """SD's 0.18215 for a 4-channel VAE; a 16-channel one (SD3's, Flux's) must be told."""
    from ldm.layout import family

    if family.vae_kind(vae) == family.VAE16:
        raise ValueError(
            f"--vae {path} is {family.VAE16}: give --scaling-factor and --shift-factor for the "
            "diffusers config (SD 3/3.5: --scaling-factor 1.5305 --shift-factor 0.0609)"
        )
    return 0.18215


def write_diffusers(
    vae: dict, folder: Path, dtype, scaling_factor: float, size: int, shift_factor: float = 0.0
) -> None:
    """A diffusers `AutoencoderKL` folder, names by the layout layer's rule (no diffusers needed)."""
    from ldm.checkpoint import save_safetensors
    from ldm.layout import diffusers_vae

    config = diffusers_vae.diffusers_config(vae, scaling_factor, size, shift_factor)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(
        diffusers_vae.to_diffusers(vae),
        folder / "diffusion_pytorch_model.safetensors",
        dtype=dtype,
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    sys.exit(main())
