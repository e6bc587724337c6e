"""LoRA / LoCon / DoRA (ldm.lora): settings, targets, the frozen base, the checkpoint layout,
merging, and the kohya key set of shared/reference (the SD1 structure at full size, on meta)."""

import json
import re
from pathlib import Path

import pytest
import torch
from lora_helpers import LOCON_DORA, build, randomize_adapters, unet_output

from ldm import checkpoint, lora
from ldm.layout.ema import ema_key
from ldm.layout.peft import LORA_PREFIX, is_adapter_name
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

ROOT = Path(__file__).resolve().parents[2]
# kohya-ss sd-scripts' own SD1 network key list, copied from shared/reference
KOHYA_REFERENCE = ROOT / "tests" / "reference" / "kohya_lora_sd1_example_keys.json"


@pytest.mark.parametrize(
    "settings, message",
    [
        ("{rank: 0}", "model.params.lora.rank: must be a positive integer"),
        ("{ranks: 4}", "model.params.lora.ranks: unknown key"),
        (
            "{targets: [attn, mlp]}",
            "model.params.lora.targets: must be a list of attn, proj, ff, conv",
        ),
        ("{alpha: -1}", "model.params.lora.alpha: must be a positive number"),
        ("{conv_rank: 1.5}", "model.params.lora.conv_rank: must be a positive integer"),
        ("{dropout: 1.0}", "model.params.lora.dropout: must be in [0, 1)"),
        ("{dora: maybe}", "model.params.lora.dora: must be true or false"),
        (
            "{base_dtype: int8}",
            "model.params.lora.base_dtype: must be one of auto, fp32, bf16, fp16",
        ),
        (
            "{text_encoder: {rank: 4, lr: 0}}",
            "model.params.lora.text_encoder.lr: must be a positive",
        ),
    ],
)
def test_bad_settings_name_their_key(settings, message):
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.from_dotlist([f"lora={settings}"]))["lora"]
    with pytest.raises(ValueError, match=re.escape(message)):
        lora.parse_settings(config)


def test_settings_are_checked_before_the_model_is_built(tiny_config, monkeypatch):
    import ldm.unet

    def no_build(*args, **kwargs):
        raise AssertionError("the UNet was built before the LoRA settings were checked")

    monkeypatch.setattr(ldm.unet.UNetModel, "__init__", no_build)
    with pytest.raises(ValueError, match="model.params.lora.rank"):
        build(tiny_config, "{rank: -2}")


@pytest.mark.parametrize("with_conv", [False, True])
def test_kohya_keys_and_shapes_equal_the_reference_network(with_conv):
    """SD1 at full size (meta device): kohya's default network (UNet transformers + text
    encoder, rank 4) and with conv_dim 4 (LoCon) - exactly the reference keys and shapes."""
    reference = json.loads(KOHYA_REFERENCE.read_text())
    expected = dict(reference["keys"])
    targets = ""
    if with_conv:
        expected.update(reference["keys_added_with_conv_dim"])
        targets = ", targets: [attn, proj, ff, conv]"
    config = ROOT / "configs" / "stable-diffusion" / "v1-inference.yaml"
    with torch.device("meta"):
        model = build(
            config, f"{{rank: 4, alpha: 1, text_encoder: {{rank: 4, alpha: 1}}{targets}}}"
        )
    ours = {k: list(v.shape) for k, v in lora.kohya_state_dict(model).items()}
    assert sorted(set(ours) ^ set(expected)) == []
    assert ours == expected


def test_only_adapters_train_in_fp32_and_the_base_is_the_original_layout(tiny_config):
    plain = build(tiny_config, None)
    model = build(tiny_config, LOCON_DORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert any(n.startswith("cond_stage_model.") for n in trainable)  # text encoder adapters
    assert not any(n.startswith("first_stage_model.") for n in trainable)
    # Every adapted group is there: attention, proj, ff, ResBlock / resampler convs, CLIP.
    layers = lora.adapter_layers(model)
    for part in (
        "attn2.to_k",
        "proj_in",
        "ff.net.2",
        "in_layers.2",
        "skip_connection",
        "op",
        "emb_layers.1",
        "mlp.fc1",
    ):
        assert any(name.endswith(part) for name in layers), part
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    base = {k for k in saved["state_dict"] if not k.startswith(LORA_PREFIX)}
    assert base == set(plain.state_dict())  # the original layout, nothing of peft in it
    adapters = {k for k in saved["state_dict"] if k.startswith(LORA_PREFIX)}
    assert len(adapters) == 3 * len(layers)  # A, B and the DoRA magnitude per layer


def test_checkpoint_layout_round_trip_and_ema_names(tiny_config, tmp_path):
    model = build(tiny_config, LOCON_DORA)
    randomize_adapters(model)
    state = model.state_dict()
    adapter = (
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.lora_B.default.weight"
    )
    saved = {"state_dict": {**state, ema_key(adapter): torch.ones(1)}}
    lora.save_layout(model, saved)
    assert ema_key(adapter.replace(".default", "")) in saved["state_dict"]
    # A fresh model (other random adapters) loads the original-layout file strictly.
    path = tmp_path / "lora.safetensors"
    checkpoint.save_safetensors(
        {k: v for k, v in saved["state_dict"].items() if not k.startswith("model_ema.")}, path
    )
    fresh = build(tiny_config, LOCON_DORA, seed=5)
    checkpoint.load_weights(fresh, path)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    # And Lightning's way back (resume) restores the module's names and the EMA's.
    lora.load_layout(fresh, saved)
    assert set(saved["state_dict"]) == set(state) | {ema_key(adapter)}


def test_a_base_checkpoint_loads_under_fresh_adapters(tiny_config, tmp_path):
    """ckpt_path = an original-layout file without adapters (an SD release, a full fine-tune)."""
    plain = build(tiny_config, None, seed=3)
    path = tmp_path / "base.safetensors"
    checkpoint.save_safetensors(plain.state_dict(), path)
    config = to_container(
        merge_configs(
            [tiny_config], [f"model.params.lora={LOCON_DORA}", f"model.params.ckpt_path={path}"]
        )
    )["model"]
    model = instantiate_from_config(config)
    # Fresh adapters (B = 0) change nothing: the output is the base model's.
    torch.testing.assert_close(unet_output(model), unet_output(plain), rtol=0, atol=1e-6)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    torch.testing.assert_close(
        saved["state_dict"]["model.diffusion_model.input_blocks.1.1.proj_in.weight"],
        plain.state_dict()["model.diffusion_model.input_blocks.1.1.proj_in.weight"],
    )


@pytest.mark.parametrize("settings", ["{rank: 4, alpha: 2}", LOCON_DORA])
def test_merged_weights_give_the_adapter_models_output(tiny_config, settings):
    model = build(tiny_config, settings).eval()
    randomize_adapters(model)
    with_adapters = unet_output(model)
    base = build(tiny_config, None).eval()
    assert (with_adapters - unet_output(base)).abs().max() > 1e-2  # the adapters do something
    assert lora.merge_adapters(model) == len(
        lora.unet_targets(base.model, model.lora_settings.targets)
    ) + (
        len(lora.text_targets(base.conditioner.transformer))
        if model.lora_settings.text_encoder
        else 0
    )
    assert not lora.has_adapters(model)
    assert set(model.state_dict()) == set(base.state_dict())
    torch.testing.assert_close(unet_output(model), with_adapters, rtol=0, atol=1e-5)


def test_merge_at_a_weight_scales_the_update(tiny_config):
    model = build(tiny_config, "{rank: 4, alpha: 2}").eval()
    randomize_adapters(model)
    base = build(tiny_config, None).eval()
    lora.merge_adapters(model, weight=0.5)
    key = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_v.weight"
    full = build(tiny_config, "{rank: 4, alpha: 2}").eval()
    randomize_adapters(full)
    lora.merge_adapters(full)
    delta_half = model.state_dict()[key] - base.state_dict()[key]
    delta_full = full.state_dict()[key] - base.state_dict()[key]
    assert delta_full.abs().max() > 1e-3
    torch.testing.assert_close(delta_half, 0.5 * delta_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("settings", ["{rank: 4, alpha: 2}", LOCON_DORA])
def test_our_kohya_file_merges_back_into_the_same_model(tiny_config, settings):
    model = build(tiny_config, settings).eval()
    randomize_adapters(model)
    expected = unet_output(model)
    state = lora.kohya_state_dict(model)
    base = build(tiny_config, None).eval()
    lora.merge_kohya(base, state)
    torch.testing.assert_close(unet_output(base), expected, rtol=0, atol=1e-5)


def test_unknown_kohya_modules_are_refused_by_name(tiny_config):
    base = build(tiny_config, None)
    state = {
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight": torch.zeros(
            4, 32
        ),
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight": torch.zeros(
            32, 4
        ),
    }
    with pytest.raises(
        ValueError,
        match="x.safetensors: 1 LoRA modules do not exist in this model, e.g. lora_unet_input_blocks_4_1",
    ):
        lora.merge_kohya(base, state, source="x.safetensors")


def test_frozen_base_held_in_bf16_with_fp32_adapters(tiny_config):
    model = build(tiny_config, "{rank: 4}").eval()
    randomize_adapters(model)
    expected = unet_output(model)
    count = lora.hold_frozen_in(model.model, torch.bfloat16)
    assert count > 0
    layer = lora.adapter_layers(model)[
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    ]
    assert layer.base_layer.weight.dtype == torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == torch.float32
    # Runs in fp32 activations outside autocast (sampling), close to the fp32 model.
    out = unet_output(model)
    assert out.dtype == torch.float32
    assert (out - expected).abs().max() < 0.05 * expected.abs().max()
