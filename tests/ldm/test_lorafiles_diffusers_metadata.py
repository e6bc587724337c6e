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


FLUX = dict(depth=1, depth_single_blocks=1, hidden_size=48, num_heads=2, in_channels=16,
            context_dim=48, pooled_dim=40, axes_dim=(4, 10, 10), guidance_embed=False)  # fmt: skip


@pytest.mark.slow
def test_a_flux_file_with_our_metadata_loads_in_diffusers_and_merges_back(tmp_path):
    """Flux.1 (`transformer.` component, q/k/v split, alpha 8 on rank 4): diffusers'
    `load_lora_into_transformer` builds its config from our metadata and gives our output; our
    own merge of the same file (metadata read) gives peft's merge."""
    import copy
    from pathlib import Path

    from diffusers import FluxPipeline, FluxTransformer2DModel
    from flux_helpers import ours_and_diffusers, tiny_converter
    from safetensors.torch import save_file

    from ldm.util import instantiate_from_config

    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs/sd3/tiny.yaml").model
    cfg.params.backbone_config = {"target": "ldm.flux.Flux", "params": FLUX}
    cfg.params.lora = {"rank": 4, "alpha": 8}
    model = instantiate_from_config(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.backbone.named_parameters():
            param.copy_(0.1 * torch.randn_like(param) + name.endswith(".scale"))
    base = {
        n.replace(".base_layer", ""): p.detach().clone()
        for n, p in model.backbone.state_dict().items()
        if "lora_" not in n
    }
    state = lora.diffusers_state_dict(model)
    path = tmp_path / "flux.safetensors"
    save_file(state, path, metadata=kohya.diffusers_metadata(state))

    theirs = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=24,
        num_attention_heads=2, joint_attention_dim=48, pooled_projection_dim=40,
        guidance_embeds=False, axes_dims_rope=(4, 10, 10),
    ).eval()  # fmt: skip
    theirs.load_state_dict(tiny_converter(48)(base), strict=True)
    loaded, metadata = FluxPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    assert metadata["transformer.lora_alpha"] == metadata["transformer.r"] == 4  # 8 / 4 is in B
    FluxPipeline.load_lora_into_transformer(
        loaded, network_alphas=None, transformer=theirs, metadata=metadata, adapter_name="ours"
    )
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in state}
    assert peft_layers(theirs, "ours") == dict.fromkeys(modules, (4, 1.0))
    mine, adapted, inputs = ours_and_diffusers(model, theirs)
    assert (adapted - diffusers_forward_base(theirs, *inputs)).abs().max() > 1e-3
    torch.testing.assert_close(mine, adapted, rtol=1e-4, atol=1e-5)

    merged, plain = copy.deepcopy(model), copy.deepcopy(model)
    lora.merge_adapters(merged)
    lora._unload(plain)
    with safe_open(str(path), framework="pt") as f:
        assert lora.merge_file(plain, state, metadata=f.metadata()) == 13
    for k, v in merged.backbone.state_dict().items():
        torch.testing.assert_close(plain.backbone.state_dict()[k], v, msg=k)


def diffusers_forward_base(theirs, x, t, context, pooled):
    from flux_helpers import diffusers_forward

    theirs.disable_adapters()
    try:
        return diffusers_forward(theirs, x, t, context, pooled)
    finally:
        theirs.enable_adapters()


@pytest.mark.parametrize(
    "fam, parameterization, prediction",
    [
        ("SD 1.x", "eps", "epsilon"),
        ("SD 2.x", "v", "v"),
        ("SDXL", "eps", "epsilon"),
        ("SD 3", "eps", None),
    ],
)
def test_kohya_metadata_names_the_prediction_type_as_kohya_does(fam, parameterization, prediction):
    """modelspec.prediction_type (kohya's sai_model_spec: "epsilon" / "v"), none for SD 3 / Flux."""
    meta = kohya.base_model_metadata(fam, [], parameterization)
    assert meta.get("modelspec.prediction_type") == prediction
