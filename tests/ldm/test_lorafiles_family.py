"""A LoRA file of another model family is one line naming both families.

The files are our own exports (kohya and diffusers format) of tiny SD 1.x, SDXL, SD 3 and Flux.1
models with adapters, so their names are the ones those trainers write; each is given to a model
of another family through `check_lora_target`, which txt2img / img2img `--lora` and
`scripts/lora.py merge` call before anything merges."""

import json
from pathlib import Path

import pytest
import torch
from lora_helpers import build
from omegaconf import OmegaConf
from safetensors.torch import save_file
from sdxl_helpers import tiny_sdxl

from ldm import checkpoint, lora
from ldm.layout import family
from ldm.util import instantiate_from_config
from lun.lora_use import check_lora_target

pytest.importorskip("peft")
lora_script = pytest.importorskip("lora")  # scripts/lora.py

ROOT = Path(__file__).resolve().parents[2]
SD3_TINY = ROOT / "configs" / "sd3" / "tiny.yaml"
FLUX = dict(depth=1, depth_single_blocks=1, hidden_size=48, num_heads=2, in_channels=16,
            context_dim=48, pooled_dim=40, axes_dim=(4, 10, 10), guidance_embed=False)  # fmt: skip


def transformer_model(flux: bool):
    cfg = OmegaConf.load(SD3_TINY).model
    if flux:
        cfg.params.backbone_config = {"target": "ldm.flux.Flux", "params": FLUX}
    cfg.params.lora = {"rank": 2, "alpha": 1}
    return instantiate_from_config(cfg).eval()


@pytest.fixture(scope="module")
def models(tiny_config):
    return {
        family.SD1: build(tiny_config, "{rank: 2, alpha: 1}"),
        family.SDXL: tiny_sdxl(extra=["model.params.lora={rank: 2, text_encoder: {rank: 2}}"]),
        family.SD3: transformer_model(flux=False),
        family.FLUX: transformer_model(flux=True),
    }


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """{(family, format): path} of each model's exports."""
    folder = tmp_path_factory.mktemp("lorafiles")
    found = {}
    for name, model in models.items():
        for fmt in ("kohya", "diffusers"):
            state = (
                lora.kohya_state_dict(model) if fmt == "kohya" else lora.diffusers_state_dict(model)
            )
            path = folder / f"{name.replace(' ', '_').replace('/', '_')}-{fmt}.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, path)
            found[name, fmt] = path
    return found


def test_each_export_is_recognised_as_its_family(files):
    expected = {
        family.SD1: family.SD1_OR_2,
        family.SDXL: family.SDXL,
        family.SD3: family.SD3,
        family.FLUX: family.FLUX,
    }
    for (name, fmt), path in files.items():  # the tiny SD 3 is 3.5 Medium's MMDiT-X (attn2)
        assert family.lora_family(family.file_keys(path)) == expected[name], (name, fmt)


def test_released_and_diffusers_names():
    """kohya-ss's own SD 1.x example file, and SDXL by diffusers' names alone (a second
    transformer block per attention: SDXL has 2 or 10, SD 1.x/2.x one)."""
    keys = json.loads(
        (ROOT / "tests" / "reference" / "kohya_lora_sd1_example_keys.json").read_text()
    )
    keys = keys["keys"] if isinstance(keys, dict) else keys
    assert family.lora_family(keys) == family.SD1_OR_2
    assert family.lora_mismatch(keys, family.SD2) is None  # SD 2.x's have the same names
    # kohya's Flux files name CLIP-L lora_te1_, as SDXL's first text encoder: blocks decide
    flux = [
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha",
        "lora_unet_single_blocks_0_linear1.alpha",
    ]
    assert family.lora_family(flux) == family.FLUX
    sdxl = "unet.down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_q.lora_A.weight"
    assert family.lora_family([sdxl]) == family.SDXL
    assert family.lora_family(["lycoris_foo.hada_w1_a"]) is None
    # diffusers' names of double blocks alone are both SD 3's and Flux's: either model takes them
    double = ["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"]
    assert family.lora_family(double) == family.SD3_OR_FLUX
    assert family.lora_mismatch(double, family.FLUX) is None
    assert family.lora_mismatch(double, family.SD3) is None
    assert family.lora_mismatch(double, family.SDXL) == "an SD 3 or Flux.1 LoRA; this model is SDXL"


# (file's family, its format, the model's family, the line)
CASES = [
    (family.FLUX, "kohya", family.SD1, "a Flux.1 LoRA; this model is SD 1.x"),
    (family.SDXL, "kohya", family.SD1, "an SDXL LoRA; this model is SD 1.x"),
    (family.SD3, "kohya", family.FLUX, "an SD 3 LoRA; this model is Flux.1"),
    (family.FLUX, "diffusers", family.SDXL, "a Flux.1 LoRA; this model is SDXL"),
    (family.SD1, "diffusers", family.FLUX, "an SD 1.x/2.x LoRA; this model is Flux.1"),
]


@pytest.mark.parametrize("lora_family, fmt, model_family, line", CASES)
def test_a_lora_of_another_family_is_one_line_naming_both(
    models, files, lora_family, fmt, model_family, line
):
    model, path = models[model_family], files[lora_family, fmt]
    assert family.model_family(model) == model_family
    with pytest.raises(checkpoint.WrongFileError) as refused:
        check_lora_target(model, [(path, 1.0)])
    assert str(refused.value) == f"--lora {path}: {line}"


def test_a_lora_of_the_family_passes(models, files):
    for name in models:
        for fmt in ("kohya", "diffusers"):
            check_lora_target(models[name], [(files[name, fmt], 1.0)])


def test_lora_merge_script_says_it_in_one_line(models, files, tiny_config, tmp_path, capsys):
    base = build(tiny_config, None)
    checkpoint.save_safetensors(base.state_dict(), tmp_path / "base.safetensors")
    flux = files[family.FLUX, "kohya"]
    argv = ["merge", tmp_path / "base.safetensors", tmp_path / "out.safetensors"]
    argv += ["--config", tiny_config, "--lora", flux]
    with pytest.raises(SystemExit) as stop:
        lora_script.main([str(a) for a in argv])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"error: --lora {flux}: a Flux.1 LoRA; this model is SD 1.x"]
    assert not (tmp_path / "out.safetensors").exists()


def test_an_empty_safetensors_is_named_as_loading_names_it(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.safetensors: an empty file \(0 bytes\)"):
        family.file_keys(empty)
    torch.save({}, tmp_path / "unused.pt")  # a pickle still goes through the safe loader
    assert family.file_keys(tmp_path / "unused.pt") == []
