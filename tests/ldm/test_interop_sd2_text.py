"""SD 2.x's text-encoder LoRA in our diffusers-format file, read by diffusers' own loader.

tests/ldm/test_lora_sd2_text.py proves the kohya file; the diffusers-format file writes the same
fused OpenCLIP q/k/v LoRA as three `text_encoder.text_model.encoder.layers.N.self_attn.{q,k,v}_proj`
LoRAs sharing lora_A, alpha / rank folded into lora_B (alpha != rank here). diffusers'
`lora_state_dict` + `load_lora_into_text_encoder` put it on the HF CLIPTextModel its single-file
converter makes of our base, which must then give our encoder's output.
"""

import pytest
import torch
from lora_helpers import build, randomize_adapters
from safetensors.torch import save_file
from test_lora_sd2_text import SETTINGS, hf_text_encoder, tiny_v2_config  # noqa: F401 (fixture)

from ldm import lora

diffusers = pytest.importorskip("diffusers")


def test_sd2_diffusers_format_text_lora_loads_in_diffusers_with_our_outputs(
    tmp_path,
    tiny_v2_config,  # noqa: F811
):
    model = build(tiny_v2_config, SETTINGS).eval()
    randomize_adapters(model)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    base_state = {k: v for k, v in saved["state_dict"].items() if not k.startswith("lora.")}
    save_file(lora.diffusers_state_dict(model), tmp_path / "sd2.safetensors")

    tokens = model.conditioner.tokenize(["a red circle on a blue ground", "a green square"])
    theirs = hf_text_encoder(base_state)
    pipeline = diffusers.StableDiffusionPipeline
    with torch.no_grad():
        base = theirs(input_ids=tokens).last_hidden_state
        ours = model.conditioner.encode_with_transformer(tokens)
        state, alphas = pipeline.lora_state_dict(str(tmp_path / "sd2.safetensors"))
        text_only = {k: v for k, v in state.items() if k.startswith("text_encoder.")}
        assert len(text_only) == 2 * 6 * 2  # 2 blocks x (q, k, v, out, fc1, fc2) x (A, B)
        pipeline.load_lora_into_text_encoder(
            text_only, network_alphas=alphas, text_encoder=theirs, prefix="text_encoder"
        )
        with_lora = theirs(input_ids=tokens).last_hidden_state
    assert (ours - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(with_lora, ours, rtol=0, atol=1e-4)
