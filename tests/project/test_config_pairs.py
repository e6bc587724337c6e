"""A shipped LoRA config trains adapters on the model its fine-tune config describes: the two
files must build the same model (backbone, first stage with its latent scale and shift,
conditioner, objective) and differ only in what training an adapter changes. Each is a copy
written for users to read whole, so nothing but this keeps them from drifting apart (the SD 3.5
LoRA configs once kept a first stage with quant convs and no 0.0609 shift: Stability's VAE then
loads wrongly and every latent is off by the shift)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# (LoRA config, the fine-tune config of the same model)
PAIRS = [
    ("stable-diffusion/v1-lora.yaml", "stable-diffusion/v1-finetune.yaml"),
    ("stable-diffusion/v1-dreambooth-lora.yaml", "stable-diffusion/v1-finetune.yaml"),
    ("sdxl/sdxl-lora.yaml", "sdxl/sdxl-finetune.yaml"),
    ("sd3/sd3.5-medium-lora.yaml", "sd3/sd3.5-medium-finetune.yaml"),
    ("sd3/sd3.5-large-lora.yaml", "sd3/sd3.5-large-finetune.yaml"),
    ("flux/flux1-dev-lora.yaml", "flux/flux1-dev-finetune-fsdp.yaml"),
]

# model.params that training adapters instead of the whole model may set differently: the
# adapters themselves, how they are optimised, and DreamBooth's own loss and dropout choices.
TRAINING_ONLY = {"lora", "optimizer_config", "scheduler_config", "min_snr_gamma", "ucg_rate"}


def model_params(name: str) -> dict:
    config = OmegaConf.load(CONFIGS / name)
    return OmegaConf.to_container(config.model.params)


def leaves(tree, path=""):
    """{dotted.path: value} of a nested config."""
    if not isinstance(tree, dict):
        return {path: tree}
    found = {}
    for key, value in tree.items():
        found.update(leaves(value, f"{path}.{key}" if path else key))
    return found


@pytest.mark.parametrize("lora, finetune", PAIRS, ids=[p[0] for p in PAIRS])
def test_a_lora_config_builds_the_model_of_its_finetune_config(lora, finetune):
    ours, theirs = (leaves(model_params(name)) for name in (lora, finetune))
    differ = sorted(
        key
        for key in set(ours) | set(theirs)
        if key.split(".")[0] not in TRAINING_ONLY
        and ours.get(key, "<absent>") != theirs.get(key, "<absent>")
    )
    assert not differ, "\n".join(
        f"{key}: {lora} has {ours.get(key, '<absent>')!r}, "
        f"{finetune} has {theirs.get(key, '<absent>')!r}"
        for key in differ
    )
