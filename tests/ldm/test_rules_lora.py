"""Every LoRA scale path against the rule as kohya-ss and ComfyUI state it, never our own output:

- LoRA (Hu et al. 2021, eq. 3) and kohya's LoRAModule: delta W = (alpha / rank) * up @ down
  (`self.scale = alpha / self.lora_dim`, sd-scripts networks/lora.py).
- A kohya file without `<name>.alpha`: alpha = rank, scale 1 (sd-scripts networks/lora.py
  `create_network_from_weights`: "support old LoRA without alpha", `modules_alpha[key] =
  modules_dim[key]`; ComfyUI comfy/weight_adapter/lora.py `calculate_weight`: `alpha = v[2] /
  rank` if an alpha is given, else 1.0).
- LoCon: `conv_dim` without `conv_alpha` -> conv_alpha = 1.0 (networks/lora.py `create_network`).
- A diffusers/peft file: the scale folded into lora_B, no alpha; with `lora_adapter_metadata` the
  alpha it names (peft LoraConfig: scaling = lora_alpha / r, lora_alpha defaulting to r).
"""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from lora_helpers import build, randomize_adapters

from ldm import lora
from ldm.layout import kohya as lora_kohya

TO_Q = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q"
CONV3 = "model.diffusion_model.input_blocks.1.0.in_layers.2"  # a ResBlock's 3x3 conv
CONV1 = "model.diffusion_model.input_blocks.3.0.skip_connection"  # a 1x1 shortcut
EMB = "model.diffusion_model.input_blocks.1.0.emb_layers.1"  # a Linear of the "conv" group
TEXT_Q = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj"


def layer_output(layer, x):
    with torch.no_grad():
        return layer(x)


def lora_update(layer, x, scale):
    """scale * B(A(x)) for a Linear, a Conv2d (A: the base's kernel/stride/padding, B: 1x1)."""
    down, up = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    base = layer.get_base_layer()
    if isinstance(base, torch.nn.Conv2d):
        hidden = F.conv2d(x, down, stride=base.stride, padding=base.padding)
        return scale * F.conv2d(hidden, up)
    return scale * F.linear(F.linear(x, down), up)


def check_scale(model, name, scale, rank):
    layer = model.get_submodule(name)
    base = layer.get_base_layer()
    assert layer.lora_A["default"].weight.shape[0] == rank
    g = torch.Generator().manual_seed(0)
    if isinstance(base, torch.nn.Conv2d):
        x = torch.randn(1, base.in_channels, 6, 6, generator=g)
    else:
        x = torch.randn(3, base.in_features, generator=g)
    with torch.no_grad():
        expected = base(x) + lora_update(layer, x, scale)
        assert lora_update(layer, x, 1.0).abs().max() > 1e-3  # B is nonzero: the scale shows
    torch.testing.assert_close(layer_output(layer, x), expected, rtol=1e-5, atol=1e-5)


# settings -> {layer: (rank, alpha / rank)} by the rules in the module docstring
TRAIN_CASES = {
    "{rank: 4, alpha: 2}": {TO_Q: (4, 0.5)},
    "{rank: 4}": {TO_Q: (4, 1.0)},  # ours: alpha defaults to rank
    "{rank: 4, alpha: 16, text_encoder: {rank: 2, alpha: 8}}": {TO_Q: (4, 4.0), TEXT_Q: (2, 4.0)},
    "{rank: 4, text_encoder: {rank: 2}}": {TEXT_Q: (2, 1.0)},
    # LoCon without conv_rank: the 3x3 convs use rank and alpha
    "{rank: 4, alpha: 2, targets: [conv]}": {CONV3: (4, 0.5), CONV1: (4, 0.5), EMB: (4, 0.5)},
    # conv_rank without conv_alpha: kohya's conv_alpha = 1; 1x1 and Linear keep rank / alpha
    "{rank: 4, alpha: 2, targets: [conv], conv_rank: 8}": {
        CONV3: (8, 1 / 8),
        CONV1: (4, 0.5),
        EMB: (4, 0.5),
    },
    "{rank: 4, alpha: 2, targets: [conv], conv_rank: 8, conv_alpha: 4}": {CONV3: (8, 0.5)},
    "{rank: 4, alpha: 2, targets: [conv], conv_alpha: 6}": {CONV3: (4, 1.5), CONV1: (4, 0.5)},
}


@pytest.mark.parametrize("settings", list(TRAIN_CASES))
def test_training_applies_alpha_over_rank(tiny_config, settings):
    model = build(tiny_config, settings).eval()
    randomize_adapters(model)
    for name, (rank, scale) in TRAIN_CASES[settings].items():
        check_scale(model, name, scale, rank)


LOCON = (
    "{rank: 4, alpha: 2, targets: [attn, conv], conv_rank: 8, text_encoder: {rank: 2, alpha: 8}}"
)


@pytest.fixture(scope="module")
def trained(tiny_config):
    """A LoCon model with random (nonzero) adapters and the base it was built on."""
    model = build(tiny_config, LOCON).eval()
    randomize_adapters(model)
    return model, build(tiny_config, None).eval()


SCALES = {TO_Q: 0.5, CONV3: 1 / 8, CONV1: 0.5, EMB: 0.5, TEXT_Q: 4.0}


def true_delta(model, name):
    """(alpha / rank) * B @ A of a layer, by the scales stated above, in the weight's shape."""
    layer = model.get_submodule(name)
    down, up = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    weight = layer.get_base_layer().weight
    return (SCALES[name] * (up.flatten(1) @ down.flatten(1))).reshape(weight.shape).detach()


def kohya_name(model, name):
    return lora_kohya.kohya_name(name, lora.res_blocks_of(model.backbone), False)


def test_kohya_export_holds_what_kohyas_rule_reads_back(trained):
    """kohya/ComfyUI apply (alpha / rank) * up @ down of the file: that must be our update."""
    model, _ = trained
    state = lora.kohya_state_dict(model)
    for name in SCALES:
        key = kohya_name(model, name)
        up, down = state[f"{key}.lora_up.weight"], state[f"{key}.lora_down.weight"]
        alpha, rank = float(state[f"{key}.alpha"]), down.shape[0]
        applied = (alpha / rank) * (up.flatten(1) @ down.flatten(1))
        torch.testing.assert_close(
            applied.reshape(true_delta(model, name).shape), true_delta(model, name)
        )
    assert float(state[f"{kohya_name(model, CONV3)}.alpha"]) == 1.0  # kohya's default conv_alpha


def test_diffusers_export_folds_the_scale_into_lora_b(trained):
    """diffusers loads a file without alpha metadata at lora_alpha = r: scale 1."""
    model, _ = trained
    state = lora.diffusers_state_dict(model)
    assert not any("alpha" in key for key in state)
    res_blocks = lora.res_blocks_of(model.backbone)
    for name in SCALES:
        component, path = lora_kohya.module_path(name, res_blocks)
        up, down = (
            state[f"{component}.{path}.lora_B.weight"],
            state[f"{component}.{path}.lora_A.weight"],
        )
        delta = (up.flatten(1) @ down.flatten(1)).reshape(true_delta(model, name).shape)
        torch.testing.assert_close(delta, true_delta(model, name))


def test_merging_our_adapters_adds_the_scaled_update(trained, tiny_config):
    model, base = trained
    merged = build(tiny_config, LOCON).eval()
    randomize_adapters(merged)
    lora.merge_adapters(merged, weight=0.25)  # not 0.5: a lerp with swapped ends is equal there
    for name in SCALES:
        got = merged.get_submodule(name).weight - base.get_submodule(name).weight
        torch.testing.assert_close(got, 0.25 * true_delta(model, name), rtol=1e-4, atol=1e-6)


def foreign_kohya_file(model, names, alpha, rank=3, seed=5):
    """A kohya file as another trainer writes it: up/down of `rank` for `names`, with an
    `.alpha` of `alpha` per module, or none (old kohya files, some converters) when None."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in names:
        weight = model.get_submodule(name).weight
        key = kohya_name(model, name)
        if weight.dim() == 4:
            down = torch.randn(rank, *weight.shape[1:], generator=g)
            up = torch.randn(weight.shape[0], rank, 1, 1, generator=g)
        else:
            down = torch.randn(rank, weight.shape[1], generator=g)
            up = torch.randn(weight.shape[0], rank, generator=g)
        state[f"{key}.lora_down.weight"], state[f"{key}.lora_up.weight"] = down, up
        if alpha is not None:
            state[f"{key}.alpha"] = torch.tensor(float(alpha))
    return state


@pytest.mark.parametrize("alpha, scale", [(None, 1.0), (1.0, 1 / 3), (6.0, 2.0)])
def test_a_foreign_kohya_file_merges_at_alpha_over_rank_and_scale_one_without_alpha(
    tiny_config, alpha, scale
):
    model = build(tiny_config, None).eval()
    before = {n: model.get_submodule(n).weight.detach().clone() for n in (TO_Q, CONV3, TEXT_Q)}
    state = foreign_kohya_file(model, list(before), alpha)
    lora.merge_file(model, state, weight=0.75)
    for name, weight in before.items():
        key = kohya_name(model, name)
        up, down = state[f"{key}.lora_up.weight"], state[f"{key}.lora_down.weight"]
        expected = weight + 0.75 * scale * (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        torch.testing.assert_close(model.get_submodule(name).weight, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "metadata, scale",
    [
        (None, 1.0),  # peft's lora_alpha defaults to r
        ({"unet.r": 3, "unet.lora_alpha": 6}, 2.0),
        ({"unet.r": 3, "unet.lora_alpha": 6, "unet.alpha_pattern": {"attn1.to_q": 1.5}}, 0.5),
    ],
)
def test_a_foreign_diffusers_file_merges_at_its_metadata_alpha(tiny_config, metadata, scale):
    model = build(tiny_config, None).eval()
    before = model.get_submodule(TO_Q).weight.detach().clone()
    g = torch.Generator().manual_seed(3)
    down, up = (
        torch.randn(3, before.shape[1], generator=g),
        torch.randn(before.shape[0], 3, generator=g),
    )
    _, path = lora_kohya.module_path(TO_Q, lora.res_blocks_of(model.backbone))
    state = {f"unet.{path}.lora_A.weight": down, f"unet.{path}.lora_B.weight": up}
    header = None if metadata is None else {"lora_adapter_metadata": json.dumps(metadata)}
    lora.merge_file(model, state, metadata=header)
    torch.testing.assert_close(
        model.get_submodule(TO_Q).weight, before + scale * up @ down, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "settings, dim, alpha, args",
    [
        ("{rank: 4}", "4", "4.0", None),
        ("{rank: 4, alpha: 1}", "4", "1.0", None),
        (
            "{rank: 4, alpha: 2, targets: [attn, conv]}",
            "4",
            "2.0",
            {"conv_dim": "4", "conv_alpha": "2"},
        ),
        (
            "{rank: 4, alpha: 2, targets: [attn, conv], conv_rank: 8}",
            "4",
            "2.0",
            {"conv_dim": "8", "conv_alpha": "1"},
        ),
        (
            "{rank: 4, targets: [attn, conv], conv_rank: 8, conv_alpha: 3}",
            "4",
            "4.0",
            {"conv_dim": "8", "conv_alpha": "3"},
        ),
    ],
)
def test_kohya_metadata_names_the_alphas_the_layers_use(settings, dim, alpha, args):
    """ss_network_dim / ss_network_alpha / ss_network_args as kohya's train_network.py writes
    them (network_args: the strings given on its command line)."""
    parsed = lora.parse_settings(yaml.safe_load(settings))
    meta = lora_kohya.kohya_metadata(parsed, "sd_v1")
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == (dim, alpha)
    assert json.loads(meta.get("ss_network_args", "null")) == args


@pytest.mark.parametrize("alpha, scale", [(None, 1.0), (1.5, 0.5)])
def test_sd2_split_qkv_from_a_kohya_file_merges_at_alpha_over_rank(
    tiny_config, tmp_path, alpha, scale
):
    """SD 2.x: kohya names the OpenCLIP tower's fused q/k/v by the split q_proj / k_proj / v_proj
    of HF CLIP; each goes to its third of `in_proj_weight` at the same rule (no alpha: scale 1)."""
    config = yaml.safe_load(tiny_config.read_text())
    config["model"]["params"]["cond_stage_config"] = {
        "target": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
        "params": {"width": 32, "layers": 3, "heads": 2, "embed_dim": 32, "layer": "penultimate"},
    }
    path = tmp_path / "tiny-v2.yaml"
    path.write_text(yaml.safe_dump(config))
    model = build(path, None).eval()
    fused = next(
        m.in_proj_weight for n, m in model.named_modules() if n.endswith("resblocks.0.attn")
    )
    before = fused.detach().clone()
    g = torch.Generator().manual_seed(4)
    state, deltas = {}, {}
    for part in ("q", "v"):
        key = f"lora_te_text_model_encoder_layers_0_self_attn_{part}_proj"
        down, up = torch.randn(3, 32, generator=g), torch.randn(32, 3, generator=g)
        state[f"{key}.lora_down.weight"], state[f"{key}.lora_up.weight"] = down, up
        if alpha is not None:
            state[f"{key}.alpha"] = torch.tensor(alpha)
        deltas[part] = scale * up @ down
    lora.merge_file(model, state)
    expected = before + torch.cat([deltas["q"], torch.zeros(32, 32), deltas["v"]])
    torch.testing.assert_close(fused.detach(), expected, rtol=1e-4, atol=1e-5)
