"""LoRA on SD 2.x's OpenCLIP text encoder, exported under the names kohya and diffusers use.

kohya-ss and diffusers run SD 2.x's text encoder as an HF CLIPTextModel converted from the
OpenCLIP tower (the fused q/k/v split into q_proj/k_proj/v_proj; the last block dropped, as the
penultimate layer is used), so their LoRA files name `lora_te_text_model_encoder_layers_N_...`.
Proof with diffusers' own code on the other side: its single-file converter
(`convert_open_clip_checkpoint`) builds the CLIPTextModel from our base weights, its kohya loader
(`lora_state_dict` + `load_lora_into_text_encoder`) applies our exported file, and the outputs
equal our encoder's with its adapters (random nonzero lora_B, so nothing hides)."""

import pytest
import torch
import yaml
from lora_helpers import build, randomize_adapters
from safetensors.torch import save_file

from ldm import lora

diffusers = pytest.importorskip("diffusers")

OPENCLIP = {"width": 32, "layers": 3, "heads": 2, "embed_dim": 32}  # penultimate: 2 blocks used
SETTINGS = "{rank: 2, alpha: 3, targets: [attn], text_encoder: {rank: 3, alpha: 5}}"


@pytest.fixture(scope="module")
def tiny_v2_config(tmp_path_factory, tiny_config):
    """The tiny config with SD 2.x's text encoder (OpenCLIP, penultimate layer) at toy width."""
    config = yaml.safe_load(tiny_config.read_text())
    config["model"]["params"]["cond_stage_config"] = {
        "target": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
        "params": {**OPENCLIP, "layer": "penultimate"},
    }
    path = tmp_path_factory.mktemp("v2") / "tiny-v2.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def hf_text_encoder(base_state: dict):
    """diffusers' conversion of the OpenCLIP tower into a 2-layer HF CLIPTextModel."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=32,
    )
    model = CLIPTextModel(config).eval()
    converted = convert_open_clip_checkpoint(model, base_state)
    level = any(k.startswith("text_model.") for k in model.state_dict())
    converted = {(k if level else k.removeprefix("text_model.")): v for k, v in converted.items()}
    result = model.load_state_dict(converted, strict=False)
    assert not result.missing_keys or result.missing_keys == ["embeddings.position_ids"]
    assert all(".layers.2." in k or "projection" in k for k in result.unexpected_keys)
    return model


@pytest.mark.slow
def test_sd2_text_encoder_lora_loads_in_diffusers_with_our_outputs(tmp_path, tiny_v2_config):
    model = build(tiny_v2_config, SETTINGS).eval()
    randomize_adapters(model)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    base_state = {k: v for k, v in saved["state_dict"].items() if not k.startswith("lora.")}
    assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in base_state
    adapters = [k for k in saved["state_dict"] if k.startswith("lora.cond_stage_model.")]
    assert "lora.cond_stage_model.model.transformer.resblocks.1.attn.lora_A.weight" in adapters

    state = lora.kohya_state_dict(model)
    text_keys = {k for k in state if k.startswith("lora_te_")}
    layers = ["self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj"]
    expected = {
        f"lora_te_text_model_encoder_layers_{i}_{layer}.{part}"
        for i in range(2)  # the last block feeds nothing: no adapter (kohya: 23 of 24 layers)
        for layer in [*layers, "mlp_fc1", "mlp_fc2"]
        for part in ("lora_down.weight", "lora_up.weight", "alpha")
    }
    assert text_keys == expected
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "sd2.safetensors")

    tokens = model.conditioner.tokenize(["a red circle on a blue ground", "a green square"])
    theirs = hf_text_encoder(base_state)
    with torch.no_grad():
        base = theirs(input_ids=tokens).last_hidden_state
        ours = model.conditioner.encode_with_transformer(tokens)
        pipeline = diffusers.StableDiffusionPipeline
        converted, alphas = pipeline.lora_state_dict(str(tmp_path / "sd2.safetensors"))
        text_only = {k: v for k, v in converted.items() if k.startswith("text_encoder.")}
        assert len(text_only) == 2 * 6 * 2  # 2 layers x 6 modules x (lora_A, lora_B)
        pipeline.load_lora_into_text_encoder(
            text_only, network_alphas=alphas, text_encoder=theirs, prefix="text_encoder"
        )
        with_lora = theirs(input_ids=tokens).last_hidden_state
    assert (ours - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(with_lora, ours, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_sd2_run_adapters_merge_into_the_fused_weight(tiny_v2_config):
    """peft's merge folds the q/k/v LoRA into `in_proj_weight`: a plain SD 2.x checkpoint with
    the same outputs, as does our kohya file merged into a plain model (the `--lora` path);
    dropout / DoRA on that tower are one config error naming the key."""
    model = build(tiny_v2_config, SETTINGS).eval()
    randomize_adapters(model)
    tokens = model.conditioner.tokenize(["a red circle"])
    kohya = lora.kohya_state_dict(model)
    plain = build(tiny_v2_config, None).eval()
    with torch.no_grad():
        expected = model.conditioner.encode_with_transformer(tokens)
        before = plain.conditioner.encode_with_transformer(tokens)
        lora.merge_adapters(model)
        merged = model.conditioner.encode_with_transformer(tokens)
        # Our kohya file (split q/k/v) merged into a plain SD 2.x model, as `--lora` does.
        assert lora.merge_file(plain, kohya) == len([k for k in kohya if k.endswith(".alpha")])
        from_file = plain.conditioner.encode_with_transformer(tokens)
    assert not lora.has_adapters(model)
    assert set(model.state_dict()) == set(build(tiny_v2_config, None).state_dict())
    assert (expected - before).abs().max() > 1e-2
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_file, expected, rtol=0, atol=1e-5)
    for bad in (
        "{rank: 2, text_encoder: {rank: 2, dropout: 0.1}}",
        "{dora: true, text_encoder: {}}",
    ):
        with pytest.raises(ValueError, match="model.params.lora.text_encoder: the OpenCLIP"):
            build(tiny_v2_config, bad)
