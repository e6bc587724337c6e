"""`--lora FILE[:WEIGHT]` of txt2img / img2img: LoRA files (kohya or diffusers format, from any
trainer) merged into the loaded model at their weights, and named in the PNG parameters the way
AUTOMATIC1111 names them: `<lora:NAME:WEIGHT>` in the prompt text and a `Lora hashes` field
(extensions-builtin/Lora: `extra_networks_lora.py` writes it, `infotext_pasted` reads it back).
"""

import dataclasses
import hashlib
import math
from pathlib import Path

import torch

from ldm import checkpoint, lora
from ldm.layout import family
from lun.cli import naming


def check_lora_files(files: list[tuple[Path, float]]) -> None:
    """Every `--lora` file holds adapters only (not a model, a VAE...): read from its keys."""
    for path, _ in files:
        with naming("--lora", path):  # damaged, or refused: which flag
            found = family.file_family(path)
        if found != family.LORA:
            hint = "a model goes to --ckpt (with its --config)"
            checkpoint.check_family(path, found, family.LORA, "--lora", "a LoRA file", hint)


def check_lora_target(model: torch.nn.Module, files: list[tuple[Path, float]]) -> None:
    """LoRA files name the UNet's and text encoders' layers, or SD 3's / Flux's blocks (kohya /
    diffusers): other backbones (DiT) have none of them, and each file's names are those of
    this model's family (`ldm.layout.family.lora_mismatch`)."""
    found = family.model_family(model)
    if files and found not in (family.SD1, family.SD2, family.SDXL, family.SD3, family.FLUX):
        raise checkpoint.WrongFileError(
            f"--lora {files[0][0]}: LoRA files apply to SD 1.x, SD 2.x, SDXL, SD 3 and Flux.1 "
            "models; this "
            f"model is {family.a(found) if found else 'another architecture'}, which has no "
            "layers of those names"
        )
    for path, _ in files:  # a LoRA for another family: before anything merges
        mismatch = family.lora_mismatch(family.file_keys(path), found)
        if mismatch:
            raise checkpoint.WrongFileError(f"--lora {path}: {mismatch}")


@dataclasses.dataclass(frozen=True)
class LoraUse:
    """One applied file: its A1111 name (the file name without extension), weight, short hash."""

    name: str
    weight: float
    short_hash: str


def parse_spec(text: str) -> tuple[Path, float]:
    """ "FILE[:WEIGHT]" -> (FILE, WEIGHT), weight 1 when none is given; a file whose own name
    holds a colon is taken whole. ValueError / FileNotFoundError naming the argument."""
    path, colon, weight = text.rpartition(":")
    if not colon or Path(text).is_file():
        path, value = text, 1.0
    else:
        try:
            value = float(weight)
        except ValueError:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--lora {text}: LoRA file not found") from None
            raise ValueError(f"--lora {text}: weight '{weight}' is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"--lora {text}: weight '{weight}' is not a finite number")
    if Path(path).is_dir():
        raise ValueError(f"--lora {path} is a folder; give a LoRA file (.safetensors)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--lora {text}: LoRA file not found: {path}")
    return Path(path), value


def safetensors_metadata(path: Path) -> dict[str, str]:
    if path.suffix != ".safetensors":
        return {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def a1111_short_hash(path: Path, metadata: dict[str, str]) -> str:
    """The hash A1111 shows for a LoRA file (network.py `NetworkOnDisk.set_hash`): kohya's
    `sshs_model_hash` metadata when present, else the SHA-256 of a .safetensors file's tensor
    data, after its JSON header (kohya-ss / additional-networks `addnet_hash_safetensors`), or
    of a whole pickle; its first 12 hex digits."""
    if metadata.get("sshs_model_hash"):
        return metadata["sshs_model_hash"][:12]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            f.seek(8 + int.from_bytes(f.read(8), "little"))
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def parse_specs(specs: list[str]) -> list[tuple[Path, float]]:
    """Every `--lora` argument checked (`parse_spec`) before a model is loaded."""
    return [parse_spec(spec) for spec in specs]


@torch.no_grad()
def apply_loras(model: torch.nn.Module, files: list[tuple[Path, float]]) -> list[LoraUse]:
    """Merge each (file, weight) into `model` (`ldm.lora.merge_file`), in order. The model's own
    adapters (a LoRA run's checkpoint) are merged first, at full strength."""
    uses = []
    if files and lora.has_adapters(model):
        lora.merge_adapters(model)
    for path, weight in files:
        metadata = safetensors_metadata(path)
        layers = merge_lora_file(model, path, weight, metadata)
        print(f"LoRA {path.name} at weight {weight:g}: {layers} layers")
        uses.append(LoraUse(path.stem, weight, a1111_short_hash(path, metadata)))
    return uses


def merge_lora_file(model: torch.nn.Module, path: Path, weight: float, metadata: dict) -> int:
    """`ldm.lora.merge_file` of one `--lora` file; its refusal (a LoRA of another family) names
    the file. Returns the number of layers merged."""
    state = checkpoint.state_dict_of(checkpoint.load_file_state(path))
    try:
        return lora.merge_file(model, state, weight, source=str(path), metadata=metadata)
    except (ValueError, KeyError) as err:
        text = str(err).strip("'")
        raise type(err)(text if str(path) in text else f"--lora {path}: {text}") from None


def tagged_prompt(prompt, uses: list[LoraUse]):
    """The prompt as A1111 users write it with these LoRAs: `... <lora:NAME:WEIGHT>`."""
    if not uses or not isinstance(prompt, str):
        return prompt
    return " ".join([prompt, *(f"<lora:{use.name}:{use.weight:g}>" for use in uses)])


def infotext_fields(uses: list[LoraUse]) -> dict[str, str]:
    """`Lora hashes: "NAME: HASH, ..."` (names without `:` and `,`, as A1111 writes them)."""
    if not uses:
        return {}
    names = [use.name.replace(":", "").replace(",", "") for use in uses]
    return {"Lora hashes": ", ".join(f"{n}: {u.short_hash}" for n, u in zip(names, uses))}
