"""LoRA files from a LoRA run, and merges into a full checkpoint.

    # kohya format (AUTOMATIC1111, ComfyUI, Forge, diffusers load_lora_weights); SDXL runs in
    # kohya's SDXL naming (lora_unet_input_blocks_..., lora_te1_, lora_te2_)
    python scripts/lora.py export logs/<run>/checkpoints/last.ckpt my-lora.safetensors
    # diffusers/peft format (pipeline.load_lora_weights reads it natively)
    python scripts/lora.py export logs/<run>/checkpoints/last.ckpt out.safetensors --format diffusers
    # the run's adapters (and/or any kohya files) merged into an original-layout checkpoint
    python scripts/lora.py merge logs/<run>/checkpoints/last.ckpt merged.safetensors --weight 0.8
    python scripts/lora.py merge --config configs/stable-diffusion/v1-inference.yaml \\
        v1-5-pruned.safetensors merged.safetensors --lora other.safetensors:0.7

--ema takes the EMA of the adapters (when the checkpoint has it).
"""

import argparse
from pathlib import Path

from lun.cli import HelpFormatter, check_output_file

# The heavy modules (torch, the models) are imported in the functions: --help answers at once.


def load_model(args):
    """The run's model (its config, adapters included) with the checkpoint's weights."""
    from ldm import checkpoint
    from ldm.util import instantiate_from_config
    from lun.config import check_complete, merge_configs, to_container
    from lun.generation import find_config
    from lun.strategies import load_training_checkpoint

    cfg = merge_configs([args.config] if args.config else find_config(Path(args.ckpt)))
    cfg.model.params.pop("ckpt_path", None)
    check_complete(cfg.model)
    model = instantiate_from_config(to_container(cfg.model))
    # A file, or a DeepSpeed / sharded FSDP folder merged into one state dict.
    contents = load_training_checkpoint(args.ckpt, unsafe=args.unsafe_load)
    checkpoint.load_weights(model, args.ckpt, ema=args.ema, contents=contents, what="ckpt")
    return model.eval()


def export(args) -> None:
    import torch

    from ldm import checkpoint, lora
    from ldm.layout import family, kohya
    from lun.generation import writing

    model = load_model(args)
    if not lora.has_adapters(model):
        raise ValueError(f"{args.ckpt}: its config has no model.params.lora: nothing to export")
    dtype = torch.float16 if args.half else None
    if args.format == "kohya":
        state = lora.kohya_state_dict(model, dtype)
        keys = list(model.state_dict())
        base = kohya.base_model_metadata(family.model_family(keys), keys, model.parameterization)
        metadata = kohya.kohya_metadata(model.lora_settings, base["ss_base_model_version"]) | base
    else:
        state = {k: v.to(dtype or v.dtype) for k, v in lora.diffusers_state_dict(model).items()}
        metadata = kohya.diffusers_metadata(state)  # the peft config diffusers builds from it
    with writing(args.out):
        checkpoint.save_safetensors(state, args.out, metadata=metadata)
    print(f"wrote {args.out} ({len(state)} tensors, {args.format} format)")


def merge(args) -> None:
    import torch

    from ldm import checkpoint, lora
    from lun.generation import writing
    from lun.lora_use import (
        check_lora_files,
        check_lora_target,
        merge_lora_file,
        parse_spec,
        safetensors_metadata,
    )

    files = [parse_spec(item) for item in args.lora]
    check_lora_files(files)  # before the model is built
    model = load_model(args)
    check_lora_target(model, files)
    merged = lora.merge_adapters(model, args.weight) if lora.has_adapters(model) else 0
    for path, weight in files:
        merged += merge_lora_file(model, path, weight, safetensors_metadata(path))
    if not merged:
        raise ValueError("nothing to merge: the checkpoint has no adapters and no --lora was given")
    state = {k: v for k, v in model.state_dict().items()}
    dtype = torch.float16 if args.half else None
    with writing(args.out):
        checkpoint.save_safetensors(state, args.out, dtype=dtype, metadata={"format": "pt"})
    print(f"wrote {args.out} ({merged} layers merged)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("export", "merge"):
        sub = commands.add_parser(name, formatter_class=HelpFormatter)
        sub.add_argument("ckpt", help="a LoRA run's checkpoint (or, for merge, any SD checkpoint)")
        sub.add_argument("out", help="output .safetensors")
        sub.add_argument("--config", help="model config (default: the run folder's saved config)")
        sub.add_argument("--ema", action="store_true", help="use the EMA weights of the adapters")
        sub.add_argument("--half", action="store_true", help="store floating tensors as fp16")
        sub.add_argument("--unsafe-load", action="store_true", help="allow pickled code")
    commands.choices["export"].add_argument(
        "--format", choices=["kohya", "diffusers"], default="kohya", help="file format"
    )
    commands.choices["merge"].add_argument(
        "--weight", type=float, default=1.0, help="the run's adapters' strength"
    )
    commands.choices["merge"].add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:WEIGHT]",
        help="LoRA files (kohya or diffusers format) to merge too",
    )
    args = parser.parse_args(argv)
    from lun.generation import check_text_file, one_line_errors

    with one_line_errors():
        check_output_file(args.out, "out", (".safetensors",))  # before the model loads
        if args.config:
            check_text_file(Path(args.config), "--config")
        export(args) if args.command == "export" else merge(args)


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    main()
