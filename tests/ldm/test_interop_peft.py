"""Our diffusers-format LoRA file read with peft's own API, without diffusers' LoRA loader.

The file is peft's state dict per component (`unet.` / `text_encoder.` + module path +
`lora_A.weight` / `lora_B.weight`) with alpha / rank folded into lora_B, so (docs/lora-rules.md)
a peft user loads it with `LoraConfig(r=rank, lora_alpha=rank, target_modules=<its modules>)`,
`inject_adapter_in_model` and `set_peft_model_state_dict` on diffusers' UNet and transformers'
CLIP - and must get our outputs (random nonzero lora_B; alpha != rank, so an unfolded scale
shows). The text encoder's names keep CLIPTextModel's `text_model.` level (transformers < 5,
kohya's names); with transformers >= 5 it is dropped, as diffusers' loader does.
"""

import pytest
import torch
from lora_helpers import (
    build,
    inputs,
    outputs_of_ours,
    outputs_of_pipeline,
    pipeline_of_base,
    randomize_adapters,
)

from ldm import lora

peft = pytest.importorskip("peft")
pytest.importorskip("diffusers")

SETTINGS = "{rank: 4, alpha: 2, targets: [attn, proj, ff], text_encoder: {rank: 2, alpha: 6}}"


def load_with_peft(component: torch.nn.Module, state: dict, prefix: str) -> int:
    """peft's own calls: one LoraConfig from the file's shapes, inject, set the state dict;
    returns the number of layers it adapted."""
    own = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if not hasattr(component, "text_model"):  # transformers >= 5's CLIPTextModel has no level
        own = {k.removeprefix("text_model."): v for k, v in own.items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in own})
    ranks = {own[f"{m}.lora_A.weight"].shape[0] for m in modules}
    assert len(ranks) == 1, ranks
    rank = ranks.pop()
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules)
    peft.inject_adapter_in_model(config, component)
    result = peft.set_peft_model_state_dict(component, own)
    assert not result.unexpected_keys, result.unexpected_keys[:3]
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys[:3]
    return len(modules)


def test_peft_loads_our_diffusers_file_and_gives_our_outputs(tmp_path, tiny_config):
    model = build(tiny_config, SETTINGS).eval()
    randomize_adapters(model)
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    x, t, context = inputs()
    base = outputs_of_pipeline(pipe, x, t, context)

    state = lora.diffusers_state_dict(model)
    layers = load_with_peft(pipe.unet, state, "unet.")
    layers += load_with_peft(pipe.text_encoder, state, "text_encoder.")
    assert layers == len(lora.adapter_layers(model))
    theirs = outputs_of_pipeline(pipe, x, t, context)
    ours = outputs_of_ours(model, x, t, context)
    for got, expected, before in zip(theirs, ours, base):
        assert (expected - before).abs().max() > 1e-2  # the adapters change the output
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
