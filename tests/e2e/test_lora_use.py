"""`txt2img --lora FILE[:WEIGHT]`: LoRA files (kohya and diffusers format) applied before sampling.

The images equal those of a checkpoint merged by `scripts/lora.py merge`; the PNG parameters
name the LoRAs as AUTOMATIC1111 does, read back by its rules (the `Lora hashes` field computed
here as A1111 / kohya hash a .safetensors LoRA: SHA-256 of the bytes after the JSON header).
A diffusers-format file written by diffusers itself (with its alpha metadata) merges to
diffusers' own outputs. Bad input: one line, exit 2, no output folder.
"""

import hashlib
import json
import re

import lora as lora_script
import numpy as np
import pytest
import torch
import txt2img
from lora_helpers import build, randomize_adapters
from PIL import Image
from png_helpers import parse_a1111_parameters
from safetensors.torch import save_file

from ldm import checkpoint, lora

SETTINGS = "{rank: 4, alpha: 2, targets: [attn, proj, ff, conv], text_encoder: {rank: 2, alpha: 1}}"
PROMPT = "a red circle, on a blue ground"


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_config):
    """A base checkpoint and one random LoRA on it as a kohya and a diffusers-format file."""
    folder = tmp_path_factory.mktemp("lora_use")
    with_adapters = build(tiny_config, SETTINGS)
    randomize_adapters(with_adapters)
    saved = {"state_dict": with_adapters.state_dict()}
    lora.save_layout(with_adapters, saved)  # the original layout + lora.*: the base apart
    base = {k: v for k, v in saved["state_dict"].items() if not k.startswith("lora.")}
    checkpoint.save_safetensors(base, folder / "base.safetensors")
    kohya = {k: v.contiguous() for k, v in lora.kohya_state_dict(with_adapters).items()}
    save_file(kohya, folder / "style.safetensors", metadata={"ss_network_module": "networks.lora"})
    save_file(lora.diffusers_state_dict(with_adapters), folder / "style_diffusers.safetensors")
    return folder


def generate(folder, tiny_config, ckpt, out, *extra) -> list[Image.Image]:
    argv = ["--config", str(tiny_config), "--ckpt", str(ckpt), "--outdir", str(folder / out)]
    argv += ["--prompt", PROMPT, "--steps", "2", "--n_samples", "2", "--seed", "5"]
    txt2img.main([*argv, "--skip_grid", "--device", "cpu", *extra])
    return [Image.open(p) for p in sorted((folder / out / "samples").glob("*.png"))]


def pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


def a1111_lora_hash(path) -> str:
    data = path.read_bytes()
    header = int.from_bytes(data[:8], "little")
    return hashlib.sha256(data[8 + header :]).hexdigest()[:12]


@pytest.mark.slow
def test_txt2img_lora_equals_the_merged_checkpoint_and_names_it_as_a1111(files, tiny_config):
    base = pixels(generate(files, tiny_config, files / "base.safetensors", "base"))
    spec = [f"{files / 'style.safetensors'}:0.7", str(files / "style_diffusers.safetensors")]
    lora_script.main(
        ["merge", "--config", str(tiny_config), str(files / "base.safetensors")]
        + [str(files / "merged.safetensors"), "--lora", spec[0], "--lora", spec[1]]
    )
    merged = pixels(generate(files, tiny_config, files / "merged.safetensors", "merged"))
    images = generate(
        files, tiny_config, files / "base.safetensors", "two", "--lora", spec[0], "--lora", spec[1]
    )
    with_lora = pixels(images)
    assert np.abs(with_lora - base).max() > 20  # the LoRAs change the images
    assert np.abs(with_lora - merged).max() <= 1  # 8-bit rounding of float noise at most

    # AUTOMATIC1111's infotext: `<lora:NAME:WEIGHT>` in the prompt, `Lora hashes` quoted.
    fields = parse_a1111_parameters(images[0].text["parameters"])
    assert fields["Prompt"] == f"{PROMPT} <lora:style:0.7> <lora:style_diffusers:1>"
    hashes = fields["Lora hashes"]
    assert hashes[0] == hashes[-1] == '"'  # A1111's quote(): it holds ':' and ','
    # Read back as A1111's Lora extension does (infotext_pasted; extra_networks re_extra_net).
    pairs = [x.strip().split(":", 1) for x in json.loads(hashes).split(",")]
    by_name = {name.strip(): short.strip() for name, short in pairs}
    assert by_name == {
        "style": a1111_lora_hash(files / "style.safetensors"),
        "style_diffusers": a1111_lora_hash(files / "style_diffusers.safetensors"),
    }
    tags = re.findall(r"<(\w+):([^>]+)>", fields["Prompt"])
    assert [(kind, *args.split(":")) for kind, args in tags] == [
        ("lora", "style", "0.7"),
        ("lora", "style_diffusers", "1"),
    ]
    assert [p for p in fields if p not in ("Prompt", "Negative prompt")][-1] == "Lora hashes"


def test_lora_bad_input_is_one_line_exit_2_before_any_output(files, tiny_config, tmp_path, capsys):
    other = tmp_path / "sdxl.safetensors"  # a LoRA of another family: its names fit nothing
    down = torch.ones(4, 32)
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": down}, other)
    style = files / "style.safetensors"
    cases = {
        str(tmp_path / "missing.safetensors"): "LoRA file not found",
        f"{tmp_path / 'missing.safetensors'}:0.5": "LoRA file not found",
        f"{style}:strong": "weight 'strong' is not a number",
        f"{style}:nan": "not a finite number",
        str(other): "an SDXL LoRA; this model is SD 1.x",
        str(files / "base.safetensors"): "is an SD 1.x checkpoint, expected a LoRA file",
    }
    for spec, expected in cases.items():
        capsys.readouterr()
        argv = ["--config", str(tiny_config), "--ckpt", str(files / "base.safetensors")]
        argv += ["--outdir", str(tmp_path / "out"), "--lora", spec, "--device", "cpu"]
        with pytest.raises(SystemExit) as stop:
            txt2img.main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1 and expected in lines[0], (spec, lines)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_diffusers_format_file_written_by_diffusers_merges_to_its_outputs(tmp_path, tiny_config):
    """`save_lora_weights` of peft adapters on diffusers' UNet and text encoder, alpha != rank
    (kept in the file's `lora_adapter_metadata`, with an alpha_pattern): merged by the code
    behind `--lora`, our model gives diffusers' outputs at weight 1, and half the change at 0.5
    on the text encoder (a linear layer of the merge)."""
    pytest.importorskip("diffusers")
    from lora_helpers import inputs, outputs_of_ours, outputs_of_pipeline, pipeline_of_base
    from peft import LoraConfig, get_peft_model_state_dict

    from lun.lora_use import apply_loras, parse_specs

    model = build(tiny_config, None).eval()
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    x, t, context = inputs()
    base = outputs_of_pipeline(pipe, x, t, context)
    unet_config = LoraConfig(
        r=3,
        lora_alpha=6,
        alpha_pattern={"attn2.to_k": 1.5},
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "conv_shortcut"],
    )
    text_config = LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj", "fc1"])
    pipe.unet.add_adapter(unet_config)
    pipe.text_encoder.add_adapter(text_config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in (pipe.unet, pipe.text_encoder):
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    pipe.save_lora_weights(
        tmp_path,
        unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder),
        weight_name="theirs.safetensors",
        unet_lora_adapter_metadata=unet_config.to_dict(),
        text_encoder_lora_adapter_metadata=text_config.to_dict(),
    )
    theirs = outputs_of_pipeline(pipe, x, t, context)

    half = build(tiny_config, None).eval()
    apply_loras(half, parse_specs([f"{tmp_path / 'theirs.safetensors'}:0.5"]))
    apply_loras(model, parse_specs([str(tmp_path / "theirs.safetensors")]))
    ours = outputs_of_ours(model, x, t, context)
    assert (theirs[0] - base[0]).abs().max() > 1e-2 and (theirs[1] - base[1]).abs().max() > 1e-2
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-4)
    # The first layer's output is linear in its weight: half the change at weight 0.5.
    layer = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.v_proj"
    probe = torch.randn(1, 32, generator=generator)
    plain = build(tiny_config, None).get_submodule(layer)(probe)
    full, mid = (m.get_submodule(layer)(probe) for m in (model, half))
    assert (full - plain).abs().max() > 1e-2
    torch.testing.assert_close(mid - plain, 0.5 * (full - plain), rtol=0, atol=1e-5)
