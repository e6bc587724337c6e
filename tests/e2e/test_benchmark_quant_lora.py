"""scripts/benchmark_quant_lora.py at toy width: both sides hold the base quantized by
bitsandbytes (or in fp8), the same adapters on the same layers, compute the same function, and
a training step moves the adapters of each."""

import pytest
import torch
from benchmark_flux import flux_forward
from benchmark_quant_lora import build, flux_inputs, optimizer, quant_lora_section, train_step

TINY = dict(depth=2, depth_single_blocks=2, hidden_size=32, num_heads=2, axes_dim=(4, 6, 6))
TINY["guidance_embed"] = True
# the class holding a quantized frozen weight: bitsandbytes' own, or fp8 storage
BASE_CLASS = {"int8": "Linear8bitLt", "nf4": "Linear4bit"}


@pytest.mark.parametrize("kind", ["int8", "nf4", "fp8"])
def test_both_sides_train_adapters_on_the_same_quantized_base(kind):
    ours, theirs = build(kind, torch.device("cpu"), TINY)
    # the fused and the adapted layers of both are quantized (LoRA: its base layer)
    our_layers = [ours.double_blocks[1].img_attn.qkv, ours.single_blocks[0].linear2.base_layer]
    their_layers = [theirs.transformer_blocks[1].attn.to_q, theirs.single_transformer_blocks[0]]
    their_layers[1] = their_layers[1].proj_out.base_layer
    for layer in our_layers:
        assert type(layer).__name__ == BASE_CLASS.get(kind, "Fp8Linear")
        assert layer.weight.element_size() == 1 and not layer.weight.requires_grad
    for layer in their_layers:
        if kind == "fp8":  # diffusers' layerwise casting: stored as float8 between calls
            assert layer.weight.dtype == torch.float8_e4m3fn
        else:
            assert type(layer).__name__ == BASE_CLASS[kind]
    batch = flux_inputs(torch.device("cpu"))
    with torch.no_grad():
        out = flux_forward(ours, batch)
        gap = (out - flux_forward(theirs, batch)).abs().max()
    # int8: the same rows, the same bits; nf4 double-quantizes the split q/k/v blocks apart;
    # fp8: ours scales each channel, diffusers casts
    assert gap <= {"int8": 1e-5}.get(kind, 0.1) * out.abs().mean()
    for model in (ours, theirs):
        before = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
        train_step(model, optimizer(model), batch)
        after = dict(model.named_parameters())
        assert all(not torch.equal(after[n], p) for n, p in before.items())


@pytest.mark.slow  # two memory-measuring processes (each imports diffusers, peft, bitsandbytes)
def test_section_prints_speed_and_memory_rows():
    """The table: one row per side and format, ratios against diffusers (1.00x for itself)."""

    class Args:
        steps, warmup = 1, 0

    rows = quant_lora_section(Args, torch.device("cpu"), kinds=("fp8",), network=TINY)
    assert len(rows) == 4 and rows[2].startswith("| fp8 diffusers |")
    assert rows[2].count("1.00x") == 2 and rows[3].startswith("| fp8 ours |")
