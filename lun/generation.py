"""Shared by scripts/txt2img.py and scripts/img2img.py: load a model, draw seeds, save PNGs.

Each PNG carries its generation parameters in a `parameters` text chunk, in the format
AUTOMATIC1111 writes (and ComfyUI / other viewers read).
"""

import argparse
import contextlib
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from PIL.PngImagePlugin import PngInfo

from ldm import checkpoint, flow
from ldm.layout import family
from ldm.layout.diffusers import is_diffusers_folder
from ldm.safe_load import check_readable
from ldm.util import instantiate_from_config
from lun.cli import check_input_file, check_output_folder, naming
from lun.config import check_complete, merge_configs, to_container
from lun.contract import LatentModel
from lun.generation_args import SAMPLER_NAMES, add_generation_args  # noqa: F401 (importable from here too)
from lun.images import make_grid
from lun.lora_use import (
    apply_loras,
    check_lora_files,
    check_lora_target,
    infotext_fields,
    parse_specs,
    tagged_prompt,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ScriptError(SystemExit):
    """Ends a script with exit status `status` after its one-line message; `str()` is the line."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.code = status


@contextlib.contextmanager
def one_line_errors():
    """What a script's user sees instead of a traceback: a refused, damaged or missing file or a
    bad value is one line naming it, exit status 2; a failed write (a full disk) is the
    system's words and the path, exit status 1."""
    try:
        yield
    except KeyError as err:  # str() of a KeyError is its repr: quoted
        _fail(str(err).strip("'"), 2)
    except (
        FileNotFoundError,
        UnidentifiedImageError,
        ValueError,
        ImportError,
        pickle.UnpicklingError,  # ldm.safe_load.UnsafeCheckpointError
    ) as err:
        _fail(str(err), 2)
    except OSError as err:
        _fail(f"{err.strerror or err} ({err.filename})" if err.filename else str(err), 1)


def _fail(message: str, status: int):
    line = "error: " + " ".join(message.split())
    print(line, file=sys.stderr)
    raise ScriptError(line, status) from None


@contextlib.contextmanager
def writing(path):
    """Errors while writing `path` as an OSError that names it. safetensors reports a full disk as
    "I/O error: No space left on device (os error 28)", PIL without the file name."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except Exception as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from err


@contextlib.contextmanager
def replaced_folder(folder: Path):
    """A folder export written aside, then moved in: the block writes into a new hidden sibling;
    when it ends well each entry written replaces its namesake in `folder` (an earlier export's
    `unet/`, `config.json`), and whatever else the user keeps there stays. A failed write (a full
    disk, a refused model) removes the new folder and leaves `folder` as it was, instead of half
    of an earlier export's files overwritten."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        yield new
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if not folder.exists():
        new.rename(folder)
        return
    replaced = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    for entry in sorted(new.iterdir()):
        target = folder / entry.name
        if os.path.lexists(target):  # a folder cannot be renamed over: it goes aside first
            target.rename(replaced / entry.name)
        entry.rename(target)
    shutil.rmtree(replaced, ignore_errors=True)
    new.rmdir()


def write_text_atomically(path: Path, text: str) -> None:
    """`path` holds the old text or the whole new one, never a part (written aside, renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pick_device(name: str | None) -> torch.device:
    """The asked device, else the first available of cuda (also ROCm), mps, cpu. A device that
    torch does not know, or that this machine lacks, is one line naming `--device` (was torch's
    RuntimeError / "Torch not compiled with CUDA enabled" traceback)."""
    if not name:
        name = (
            "cuda"
            if torch.cuda.is_available()
            else "mps"
            if torch.backends.mps.is_available()
            else "cpu"
        )
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device name (cpu, cuda, cuda:1, mps)") from None
    available = {
        "cpu": lambda: True,
        "cuda": lambda: (
            torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
        ),
        "mps": torch.backends.mps.is_available,
    }.get(device.type, lambda: True)
    if not available():
        raise ValueError(f"--device {name}: this machine has no such device")
    return device


def find_config(ckpt: Path) -> list[Path]:
    """A checkpoint inside a run folder (`<run>/checkpoints/x.ckpt`) names its own configs: all
    of them, as a resume merges them (the model's may refer to the trainer's, as in
    `total_steps: ${lightning.trainer.max_steps}`)."""
    configs = sorted((ckpt.parent.parent / "configs").glob("*.yaml"))
    if not configs:
        raise FileNotFoundError(f"no --config given and no saved config next to {ckpt}")
    return configs


def load_model(args, flag: str = "--ckpt") -> LatentModel:
    """Build the model from its config and load the checkpoint strictly (EMA as asked)."""
    ckpt = Path(args.ckpt)
    folder = is_diffusers_folder(ckpt)  # converted to the original layout on load
    if ckpt.is_dir() and not folder:
        raise ValueError(
            f"{flag} {ckpt} is a folder, neither a weights file (.safetensors / .ckpt) nor a "
            "diffusers folder (model_index.json)"
        )
    if not (ckpt.is_file() or folder):
        raise FileNotFoundError(f"{flag} {ckpt}: no such file or diffusers folder")
    check_vae_path(getattr(args, "vae", None))
    if folder and not args.config:
        raise ValueError(f"{ckpt}: a diffusers folder needs --config (the model's YAML)")
    with naming(flag, ckpt):
        if not args.config:  # a VAE or LoRA file is named as such, not asked for its config
            check_model_file(ckpt, None, flag, args.unsafe_load)
    cfg = model_config(args)
    cfg.model.params.pop("ckpt_path", None)  # weights come from --ckpt
    check_complete(cfg.model)
    expected = family.model_family(to_container(cfg.model))  # built on the meta device
    with naming(flag, ckpt):
        check_model_file(ckpt, expected, flag, args.unsafe_load)
    model = instantiate_from_config(to_container(cfg.model))
    with naming(flag, ckpt):
        checkpoint.load_weights(model, ckpt, ema=args.ema, unsafe=args.unsafe_load, what=flag)
    if getattr(args, "vae", None):
        with naming("--vae", args.vae):
            load_vae(model, args.vae)
    return model.eval().to(pick_device(args.device))


def check_vae_path(vae: str | None) -> None:
    """`--vae` names a weights file; a diffusers AutoencoderKL folder is read from its file."""
    if vae:
        give = (
            "a VAE weights file (.safetensors / .ckpt); of a diffusers AutoencoderKL folder, its "
            "diffusion_pytorch_model.safetensors"
        )
        check_weights_file(vae, "--vae", give)  # damaged or refused: before the model is built


def check_weights_file(path, flag: str, give: str = "a weights file", missing: str = "") -> None:
    """A weights file a flag names, there and readable (`ldm.safe_load.check_readable`: the
    header, or the pickle weights-only), before anything slow: one line naming the flag."""
    check_input_file(path, flag, give, missing)
    with naming(flag, path):
        check_readable(path)


def check_model_file(path, expected: str | None, what: str, unsafe: bool = False) -> None:
    """A diffusion model's file, of the `expected` family when known, read from its keys before
    anything is built: a VAE, a LoRA file or another family's checkpoint is one line."""
    found = family.file_family(path, unsafe)
    # No diffusion family to compare with (a model of our own making, or a VAE run's folder
    # whose saved config is the VAE's): a VAE or LoRA file is still no model to sample.
    if expected in (None, family.VAE, family.LORA) and found in (family.VAE, family.LORA):
        expected_text = "a diffusion model checkpoint"
        checkpoint.check_family(path, found, "model", what, expected_text)
    checkpoint.check_family(path, found, expected, what)


def model_config(args):
    """The merged config of `--config` (one or several files), else of the run folder."""
    configs = args.config if isinstance(args.config, list) else [args.config]
    if args.config:
        for path in map(Path, configs):
            check_text_file(path, "--config")
    config = merge_configs(configs if args.config else find_config(Path(args.ckpt)))
    if "model" not in config:  # a run folder's *-lightning.yaml, say
        raise ValueError(
            f"--config {' '.join(map(str, configs))}: no model section; give the model's config "
            "(in a run folder: configs/*-project.yaml)"
        )
    return config


def check_text_file(path: Path, flag: str) -> str:
    """The UTF-8 text of a file a flag names (a config, a prompt list): missing, a folder or
    binary bytes (a checkpoint given as --config) are one line naming the flag."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{flag} {path}: not a text file (byte {err.start} is not UTF-8); is it the right file?"
        ) from None


def read_prompt_lines(path, flag: str = "--from-file") -> list[str]:
    """One prompt per line, blank lines skipped; a file with none is one line naming it."""
    path = Path(path)
    prompts = [line.strip() for line in check_text_file(path, flag).splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{flag} {path}: no prompts in it (one prompt per line)")
    return prompts


def load_vae(model: LatentModel, path: str) -> None:
    """Replace the model's first stage with the VAE in `path` (strict: every weight, same shapes)."""
    model.load_first_stage(path, what="--vae")


def check_conditioning(model: LatentModel, args) -> None:
    """A class model draws `--class`, a text model `--prompt`: the other is one line."""
    classes = model.class_count is not None
    if classes and not getattr(args, "classes", None):
        raise ValueError(
            f"this model draws classes ({model.class_count} of them), not prompts: "
            "give --class ID or --class NAME instead of --prompt / --from-file"
        )
    if not classes and getattr(args, "classes", None):
        raise ValueError("--class: this model is text-conditional; give --prompt instead")
    if classes and getattr(args, "from_file", None):
        raise ValueError(
            "--from-file: this model draws classes; give them as --class (it was ignored)"
        )


def class_names(args) -> list[str]:
    """The class names of the model's training data (`lun.data.class_folder`): its folders'
    names, or its `idx_to_prompt`, when the config names a class-folder dataset."""
    from lun.data.class_folder import load_class_names

    data = model_config(args).get("data") or {}
    params = ((data.get("params") or {}).get("train") or {}).get("params") or {}
    root = params.get("data_root")
    if not isinstance(root, str) or not os.path.isdir(root):
        return []
    folders = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name[0] == ".")
    return load_class_names(params.get("idx_to_prompt"), folders)


def class_ids(args, num_classes: int) -> list[int]:
    """`--class` values as ids: numbers, or names of the training data's classes."""
    names = None
    ids = []
    for value in args.classes:
        if str(value).lstrip("-").isdigit():
            ids.append(int(value))
            continue
        names = class_names(args) if names is None else names
        if value not in names:
            known = f"one of {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
            raise ValueError(
                f"--class {value}: not a class id or name"
                + (f" ({known})" if names else " (the config names no class folders: give ids)")
            )
        ids.append(names.index(value))
    for value in ids:
        if not 0 <= value < num_classes:
            raise ValueError(f"--class {value}: this model has classes 0..{num_classes - 1}")
    return ids


def vae_parameters(args) -> dict[str, str]:
    """The PNG fields AUTOMATIC1111 writes for a chosen VAE: its hash (first 10 hex digits of
    the file's SHA-256) and its file name."""
    if not getattr(args, "vae", None):
        return {}
    return {"VAE hash": checkpoint.file_hash(args.vae), "VAE": Path(args.vae).name}


def read_prompts(args, num_classes: int | None = None) -> list[str | int]:
    """The prompts to draw, or the class ids of `--class`."""
    if getattr(args, "classes", None):
        return class_ids(args, num_classes) if num_classes else [int(c) for c in args.classes]
    if args.from_file:
        return read_prompt_lines(args.from_file)
    return [args.prompt]


def a1111_parameters(
    prompt: str,
    negative: str,
    args,
    seed: int,
    width: int,
    height: int,
    model_hash: str,
    extra: dict | None = None,
) -> str:
    sampler = SAMPLER_NAMES[args.sampler] + (" Karras" if args.karras else "")
    fields = {
        "Steps": args.steps,
        "Sampler": sampler,
        "CFG scale": args.scale,
        "Seed": seed,
        "Size": f"{width}x{height}",
        "Model hash": model_hash,
        **(extra or {}),
    }
    lines = [prompt if isinstance(prompt, str) else f"class {prompt}"]
    if negative:
        lines.append(f"Negative prompt: {negative}")
    lines.append(", ".join(f"{k}: {a1111_quote(v)}" for k, v in fields.items()))
    return "\n".join(lines)


def a1111_quote(value) -> str:
    """A1111's `infotext_utils.quote`: a value holding `,`, `:` or a newline as a JSON string."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) in [-1, 1] -> 8-bit RGB image."""
    array = ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array)


def save_png(image: Image.Image, path: Path, parameters: str | None = None) -> None:
    """A new PNG (`next_free` names it), removed again when its write fails (a full disk)."""
    info = None
    if parameters is not None:
        info = PngInfo()
        info.add_text("parameters", parameters)
    try:
        with writing(path):
            image.save(path, pnginfo=info)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def next_free(folder: Path, prefix: str = "") -> int:
    """The number after the highest of the files `folder/<prefix><number>.png` already there, so
    a new image never replaces one of an earlier run (counting them would, when one was deleted:
    with 00000.png and 00002.png there, the count 2 overwrote 00002.png)."""
    numbers = [p.stem[len(prefix) :] for p in folder.glob(f"{prefix}*.png")]
    return max((int(n) for n in numbers if n.isdigit()), default=-1) + 1


def starting_noise(seeds: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """One noise tensor per seed, so each image is reproducible on its own from its seed."""
    return torch.stack(
        [
            torch.randn(shape, generator=torch.Generator(device).manual_seed(s), device=device)
            for s in seeds
        ]
    )


DEFAULT_SCALE = 7.5  # the original SD scripts' CFG scale
GUIDANCE_FIELD = "Distilled CFG Scale"  # Forge's PNG field for Flux dev's embedded guidance


def is_flow_model(model) -> bool:
    return getattr(getattr(model, "objective", None), "name", None) == "flow"


def resolve_sampling(model, args) -> argparse.Namespace:
    """`args` with the family's defaults filled in, as they are then used and written to the PNG:
    the sampler (ddim, or euler for a flow model: "ddim" there is an alias of euler, so the
    PNG said "DDIM" for an Euler run), the CFG scale (7.5, or 1 for Flux, which diffusers'
    FluxPipeline and BFL sample without CFG: 7.5 ran a second, unconditional pass on top of the
    distilled guidance), and Flux dev's embedded `--guidance` (set on the conditioner)."""
    resolved = argparse.Namespace(**vars(args))
    flow_model = is_flow_model(model)
    sampler = args.sampler or ("euler" if flow_model else "ddim")
    if flow_model:
        sampler = flow.SAMPLER_ALIASES.get(sampler, sampler)
        if sampler not in flow.FLOW_SAMPLERS:
            raise ValueError(
                f"--sampler {args.sampler}: a flow model (SD3, Flux) samples with "
                f"{' or '.join(flow.FLOW_SAMPLERS)}"
            )
        if args.karras or args.eta:
            raise ValueError(
                "--karras and --eta are DDPM sampler options: leave them out for a flow model"
            )
    elif args.steps > model.num_timesteps:  # a DDPM sampler visits distinct training steps
        raise ValueError(
            f"--steps {args.steps}: this model has {model.num_timesteps} training steps, the most "
            "a sampler can visit"
        )
    resolved.sampler = sampler
    if args.scale is None:
        resolved.scale = 1.0 if model.guidance_distilled else DEFAULT_SCALE
    if args.negative_prompt and model.class_count is not None:
        raise ValueError(
            "--negative-prompt: a class-conditional model guides against the null class; "
            "leave it out (it was ignored, yet written to the PNG)"
        )
    if args.negative_prompt and resolved.scale == 1.0:
        raise ValueError(
            "--negative-prompt is used by classifier-free guidance, which --scale 1 does not run "
            "(no unconditional pass): give --scale above 1, or leave the negative prompt out"
        )
    if args.guidance is not None:
        if model.embedded_guidance is None:
            raise ValueError(
                "--guidance: this model takes no distilled guidance (Flux dev does); use --scale "
                "for classifier-free guidance"
            )
        model.embedded_guidance = args.guidance
    resolved.guidance = model.embedded_guidance
    return resolved


def image_size(model, args, init_image: Image.Image | None) -> tuple[int, int]:
    """(height, width) of the images to make: --H / --W, else the init image's size rounded down
    to the model's multiple (its VAE's downscale times its patch size), else the model's own. A
    flag not a multiple is one line naming it (was "height and width must be ...")."""
    multiple = getattr(model, "size_multiple", 1)
    for flag, value in (("--H", args.H), ("--W", args.W)):
        if value is not None and value % multiple:
            lower = value - value % multiple
            nearest = " or ".join(str(n) for n in (lower, lower + multiple) if n > 0)
            raise ValueError(
                f"{flag} {value}: height and width must be multiples of {multiple} for this model "
                f"(e.g. {nearest})"
            )
    # A backbone with a fixed position table (MMDiT) takes latents up to a side.
    largest = model.max_latent_side
    for flag, value in (("--H", args.H), ("--W", args.W)):
        if largest is not None and value is not None and value > largest * model.downscale:
            raise ValueError(
                f"{flag} {value}: at most {largest * model.downscale} for this model (the size "
                "its position table was made for)"
            )
    if init_image is not None:
        default_width, default_height = (
            max(side - side % multiple, multiple) for side in init_image.size
        )
    else:
        default_height = default_width = model.default_image_size
    return args.H or default_height, args.W or default_width


def generate(
    args, init_image: Image.Image | None = None, extra_params: dict | None = None
) -> list[Path]:
    """Run the sampling loop of txt2img / img2img; returns the written sample paths.
    `init_image` (img2img) is resized to the size made."""
    lora_files = parse_specs(getattr(args, "lora", []))  # checked before the model loads
    check_lora_files(lora_files)
    check_output_folder(args.outdir, "--outdir")
    pick_device(args.device)  # an unknown or absent device: before the model loads
    if args.from_file and not getattr(args, "classes", None):
        read_prompt_lines(args.from_file)  # before the model loads
    model = load_model(args)
    check_conditioning(model, args)
    check_lora_target(model, lora_files)
    args = resolve_sampling(model, args)
    prompts = read_prompts(args, model.class_count)
    loras = apply_loras(model, lora_files)
    device = model.device
    model_hash = checkpoint.file_hash(args.ckpt)
    extra_params = {**(extra_params or {}), **vae_parameters(args)}
    if args.guidance is not None:
        extra_params[GUIDANCE_FIELD] = args.guidance
    height, width = image_size(model, args, init_image)
    latent_shape = model.latent_shape(height, width)  # checks the sizes fit the model
    init_images = None if init_image is None else image_tensor(init_image, width, height)
    outdir = Path(args.outdir)
    sample_dir = outdir / "samples"
    sample_dir.mkdir(parents=True, exist_ok=True)
    count = next_free(sample_dir)
    autocast = (
        torch.autocast(device.type, dtype=DTYPES[args.dtype or "bf16"])
        if args.precision == "autocast"
        else contextlib.nullcontext()
    )
    written, all_images = [], []
    for prompt in prompts:
        for iteration in range(args.n_iter):
            first = args.seed + (0 if args.fixed_code else iteration * args.n_samples)
            seeds = list(range(first, first + args.n_samples))
            init = (
                None
                if init_images is None
                else init_images.to(device).expand(args.n_samples, -1, -1, -1)
            )
            # A class's unconditional side is the null class; a prompt's the negative prompt.
            negative = [args.negative_prompt] * args.n_samples if isinstance(prompt, str) else None
            with torch.no_grad(), autocast:
                images = model.sample(
                    [prompt] * args.n_samples,
                    negative,
                    height=height,
                    width=width,
                    sampler=args.sampler,
                    steps=args.steps,
                    scale=args.scale,
                    eta=args.eta,
                    karras=args.karras,
                    generator=torch.Generator(device).manual_seed(first),
                    noise=starting_noise(seeds, latent_shape, device),
                    init_images=init,
                    strength=getattr(args, "strength", 1.0),
                )
            for image, seed in zip(images, seeds):
                path = sample_dir / f"{count:05d}.png"
                params = a1111_parameters(
                    tagged_prompt(prompt, loras),
                    args.negative_prompt,
                    args,
                    seed,
                    width,
                    height,
                    model_hash,
                    {**(extra_params or {}), **infotext_fields(loras)},
                )
                save_png(to_pil(image), path, params)
                written.append(path)
                count += 1
            all_images.append(images.float().cpu())
    if not args.skip_grid:
        grid_count = next_free(outdir, "grid-")
        grid = make_grid(torch.cat(all_images), nrow=args.n_samples)
        save_png(Image.fromarray(grid), outdir / f"grid-{grid_count:04d}.png")
    print(f"wrote {len(written)} image{'' if len(written) == 1 else 's'} to {sample_dir}")
    return written


def open_init_image(path: str) -> Image.Image:
    """`--init-img` as an 8-bit RGB image: transparency flattened onto white (A1111's default
    img2img background; `convert("RGB")` alone turned transparent pixels into whatever colour
    they hid, often black), 16-bit grayscale scaled to 8 bits (`convert` clipped it: white)."""
    if Path(path).is_dir():
        raise ValueError(f"--init-img {path} is a folder; give an image file")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--init-img {path}: no such file")
    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"--init-img {path}: not an image file PIL can read") from None
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        high = 65535 if image.mode.startswith("I;16") else max(image.getextrema()[1], 1)
        gray = np.asarray(image, dtype=np.float64) * (255 / high)
        image = Image.fromarray(gray.clip(0, 255).round().astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return image.convert("RGB")


def image_tensor(image: Image.Image, width: int, height: int) -> torch.Tensor:
    """An RGB image -> (1, 3, height, width) in [-1, 1] (resized with Lanczos when another size)."""
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0)
