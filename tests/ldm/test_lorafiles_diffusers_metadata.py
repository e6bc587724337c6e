"""Our diffusers-format LoRA file carries the peft config diffusers builds from it.

`scripts/lora.py export --format diffusers` writes diffusers' `lora_adapter_metadata` (per
component, `LoraConfig.to_dict()` prefixed `unet.` / `text_encoder.`), so diffusers'
`load_lora_weights` builds its LoraConfig from the file instead of inferring one. Checked with
diffusers' own loader on a LoCon + DoRA + text-encoder LoRA (alpha != rank, conv_rank != rank,
random nonzero lora_B, moved magnitudes): the loaded peft configs are ours, layer by layer, and
the outputs are peft's merge of our adapters."""

import json

import pytest
import torch
from lora_helpers import (
    LOCON_DORA,
    build,
    inputs,
    outputs_of_ours,
    outputs_of_pipeline,
    pipeline_of_base,
    randomize_adapters,
)
from omegaconf import OmegaConf
from safetensors import safe_open

from ldm import lora
from ldm.layout import kohya
from lun.config import merge_configs

diffusers = pytest.importorskip("diffusers")
lora_script = pytest.importorskip("lora")  # scripts/lora.py


def exported(model, tiny_config, folder):
    """`scripts/lora.py export --format diffusers` of `model` as a LoRA run's checkpoint."""
    folder.mkdir()
    config = merge_configs([tiny_config], [f"model.params.lora={LOCON_DORA}"])
    OmegaConf.save(config, folder / "lora.yaml")
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    torch.save(saved, folder / "last.ckpt")
    out = folder / "adapter.safetensors"
    lora_script.main(
        ["export", str(folder / "last.ckpt"), str(out), "--config", str(folder / "lora.yaml")]
        + ["--format", "diffusers"]
    )
    return out


def expected_layers(model):
    """{component: {module path in diffusers' component: (rank, alpha / rank)}} of our adapters."""
    found = {}
    for name, layer in lora.adapter_layers(model).items():
        scale = layer.lora_alpha[lora.ADAPTER] / layer.r[lora.ADAPTER]
        for part, down, _ in lora._exported_parts(name, layer, lora.ADAPTER):
            component, path = kohya.module_path(part, lora.res_blocks_of(model.backbone))
            path = path.removeprefix("text_model.")
            found.setdefault(component, {})[path] = (down.shape[0], scale)
    return found


def peft_layers(module, adapter):
    """{module path: (rank, scaling)} of the peft layers diffusers made in `module`."""
    from peft.tuners.lora import LoraLayer

    return {
        name.removeprefix("text_model."): (layer.r[adapter], layer.scaling[adapter])
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
    }


@pytest.mark.slow
def test_diffusers_builds_our_peft_config_from_the_file_and_gives_our_outputs(
    tmp_path, tiny_config
):
    model = build(tiny_config, LOCON_DORA).eval()
    randomize_adapters(model)
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    path = exported(model, tiny_config, tmp_path / "run")

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    _, alphas, stored = pipe.lora_state_dict(str(path), return_lora_metadata=True)
    assert alphas is None
    assert stored == json.loads(metadata[kohya.LORA_ADAPTER_METADATA])  # diffusers reads it

    expected = expected_layers(model)
    for component in ("unet", "text_encoder"):
        fields = {k.split(".", 1)[1]: v for k, v in stored.items() if k.startswith(component + ".")}
        ranks = {p: rank for p, (rank, _) in expected[component].items()}
        assert sorted(fields["target_modules"]) == sorted(ranks)
        assert fields["use_dora"] is True
        for p, rank in ranks.items():  # each layer's rank, from r or rank_pattern
            assert fields["rank_pattern"].get(p, fields["r"]) == rank
            assert fields["alpha_pattern"].get(p, fields["lora_alpha"]) == rank  # scale in B
    assert {r for r, _ in expected["unet"].values()} == {2, 3}  # LoCon's conv_rank: a pattern
    assert {s for _, s in expected["unet"].values()} != {1.0}  # alpha != rank: B is scaled

    pipe.load_lora_weights(path.parent, weight_name=path.name, adapter_name="ours")
    for component, module in (("unet", pipe.unet), ("text_encoder", pipe.text_encoder)):
        config = module.peft_config["ours"]
        assert config.use_dora and config.r == 2
        layers = peft_layers(module, "ours")
        assert {p: r for p, (r, _) in layers.items()} == {
            p: r for p, (r, _) in expected[component].items()
        }
        assert all(scaling == 1.0 for _, scaling in layers.values())

    x, t, context = inputs()
    theirs = outputs_of_pipeline(pipe, x, t, context)
    ours = outputs_of_ours(model, x, t, context)
    torch.testing.assert_close(theirs[0], ours[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(theirs[1], ours[1], rtol=0, atol=1e-4)
