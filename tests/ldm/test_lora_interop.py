"""Our LoRA files in diffusers' own loader, and diffusers' kohya files in ours.

The pipeline is built from our `--to-diffusers` export of the base weights (diffusers' converters);
adapters have random nonzero lora_B and moved DoRA magnitudes, so a wrong name, a swapped
up/down, a lost alpha or a skipped group shows up in the outputs."""

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
from safetensors.torch import load_file, save_file

from ldm import lora

diffusers = pytest.importorskip("diffusers")

SETTINGS = {
    "lora": "{rank: 4, alpha: 2, text_encoder: {rank: 2, alpha: 1}}",
    "locon": "{rank: 2, alpha: 1, targets: [attn, proj, ff, conv], conv_rank: 3, conv_alpha: 6}",
    "locon-dora": LOCON_DORA,
}


# diffusers' kohya converter drops DoRA's dora_scale ("not compatible in Diffusers"): kohya DoRA
# files are checked against ComfyUI's rule below instead.
CASES = [
    (k, s) for k in ("kohya", "diffusers") for s in SETTINGS if (k, s) != ("kohya", "locon-dora")
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, settings", CASES)
def test_diffusers_loader_reads_our_files_and_gives_our_outputs(
    tmp_path, tiny_config, kind, settings
):
    model = build(tiny_config, SETTINGS[settings]).eval()
    randomize_adapters(model)
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    x, t, context = inputs()
    base_unet, base_text = outputs_of_pipeline(pipe, x, t, context)

    state = lora.kohya_state_dict(model) if kind == "kohya" else lora.diffusers_state_dict(model)
    save_file(state, tmp_path / "adapter.safetensors")
    pipe.load_lora_weights(tmp_path, weight_name="adapter.safetensors")
    theirs = outputs_of_pipeline(pipe, x, t, context)
    ours = outputs_of_ours(model, x, t, context)

    assert (ours[0] - base_unet).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(theirs[0], ours[0], rtol=0, atol=1e-4)
    if "text_encoder" in SETTINGS[settings]:
        assert (ours[1] - base_text).abs().max() > 1e-2
    torch.testing.assert_close(theirs[1], ours[1], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_a_kohya_file_written_by_diffusers_merges_into_our_model(tmp_path, tiny_config):
    """diffusers' own `convert_state_dict_to_kohya` of a peft adapter on its UNet: our merge gives
    the output diffusers gives with that adapter."""
    from diffusers.utils import convert_state_dict_to_kohya
    from peft import LoraConfig, get_peft_model_state_dict

    model = build(tiny_config, None).eval()
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1", "conv_shortcut"]
    # alpha = rank: convert_state_dict_to_kohya writes alpha = rank whatever lora_alpha was.
    pipe.unet.add_adapter(LoraConfig(r=3, lora_alpha=3, target_modules=targets))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in pipe.unet.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    peft_state = {f"unet.{k}": v for k, v in get_peft_model_state_dict(pipe.unet).items()}
    kohya = convert_state_dict_to_kohya(peft_state)
    kohya = {
        k.replace("lora_unet.", "lora_unet_") if "." in k.split(".")[0] else k: v
        for k, v in kohya.items()
    }
    save_file({k: v.contiguous() for k, v in kohya.items()}, tmp_path / "theirs.safetensors")

    x, t, context = inputs()
    theirs = outputs_of_pipeline(pipe, x, t, context)[0]
    assert lora.merge_kohya(model, load_file(tmp_path / "theirs.safetensors")) > 0
    ours = outputs_of_ours(model, x, t, context)[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def comfyui_weight_decompose(dora_scale, weight, lora_diff, alpha, strength):
    """ComfyUI v0.3.77 comfy/weight_adapter/base.py `weight_decompose` (float32, no dtype
    function): how ComfyUI and Forge apply a kohya-format DoRA layer. Transcribed unchanged;
    note the output-axis branch divides by the norm of the base weight."""
    lora_diff = lora_diff * alpha
    weight_calc = weight + lora_diff
    wd_on_output_axis = dora_scale.shape[0] == weight_calc.shape[0]
    if wd_on_output_axis:
        weight_norm = (
            weight.reshape(weight.shape[0], -1)
            .norm(dim=1, keepdim=True)
            .reshape(weight.shape[0], *[1] * (weight.dim() - 1))
        )
    else:
        weight_norm = (
            weight_calc.transpose(0, 1)
            .reshape(weight_calc.shape[1], -1)
            .norm(dim=1, keepdim=True)
            .reshape(weight_calc.shape[1], *[1] * (weight_calc.dim() - 1))
            .transpose(0, 1)
        )
    weight_norm = weight_norm + torch.finfo(weight.dtype).eps
    weight_calc = weight_calc * (dora_scale / weight_norm)
    if strength != 1.0:
        return weight + strength * (weight_calc - weight)
    return weight_calc


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_kohya_dora_file_under_comfyuis_rule_gives_our_merged_weights(tiny_config, strength):
    """Each layer of our kohya DoRA file, applied by ComfyUI's rule (LoRA diff = up @ down
    scaled by alpha / rank, then weight_decompose), gives our model's merged weight."""
    model = build(tiny_config, LOCON_DORA).eval()
    randomize_adapters(model)
    state = lora.kohya_state_dict(model)
    base = {k: v.clone() for k, v in build(tiny_config, None).state_dict().items()}
    modules = lora.kohya_modules(build(tiny_config, None))
    lora.merge_adapters(model, weight=strength)
    merged = model.state_dict()
    names = sorted(k.removesuffix(".dora_scale") for k in state if k.endswith(".dora_scale"))
    assert len(names) == 3 * 0 + len(lora.adapter_layers(build(tiny_config, LOCON_DORA)))
    for name in names:
        key = modules[name] + ".weight"
        weight = base[key]
        up, down = state[name + ".lora_up.weight"], state[name + ".lora_down.weight"]
        lora_diff = torch.mm(up.flatten(1), down.flatten(1)).reshape(weight.shape)
        alpha = float(state[name + ".alpha"]) / down.shape[0]
        expected = comfyui_weight_decompose(
            state[name + ".dora_scale"], weight, lora_diff, alpha, strength
        )
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=2e-5, msg=name)
        assert (expected - weight).abs().max() > 1e-3  # each layer changes
