"""ldm.lora_fast: the one-GEMM LoRA forward gives peft's outputs and gradients."""

import copy

import pytest
import torch
from lora_helpers import build
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from ldm import lora, lora_fast


def _layers(**config):
    """peft's layer and the fast one, same weights: scale alpha / r = 3 and a nonzero B."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10))
    model.requires_grad_(False)
    config = {"r": 4, "lora_alpha": 12, "target_modules": ["0"], **config}
    inject_adapter_in_model(LoraConfig(**config), model)
    with torch.no_grad():
        model[0].lora_B["default"].weight.normal_()
    fast = copy.deepcopy(model)
    assert lora_fast.use_fast_forward(fast) == (1 if lora_fast.can_use(model[0]) else 0)
    return model[0], fast[0]


def _run(layer, x):
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * torch.linspace(-1, 2, out.shape[-1])).sum().backward()
    grads = [x.grad] + [layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
    return out.detach(), grads


def test_fast_forward_gives_peft_outputs_and_gradients():
    peft_layer, fast = _layers()
    assert type(fast) is lora_fast.FastLoraLinear and type(peft_layer) is LoraLinear
    assert fast.state_dict().keys() == peft_layer.state_dict().keys()
    x = torch.randn(2, 5, 12)  # (B, T, in): the attention projections' input
    out, grads = _run(fast, x)
    want, want_grads = _run(peft_layer, x)
    assert out.shape == (2, 5, 10)
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # addmm out of place, in autocast's dtype
        out, want = fast(x), peft_layer(x)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=0.05, rtol=0.02)


def test_merged_or_disabled_layers_take_peft_path():
    peft_layer, fast = _layers()
    x = torch.randn(3, 12)
    fast.merge()
    torch.testing.assert_close(fast(x), peft_layer(x))  # not the update added twice
    fast.unmerge()
    fast.enable_adapters(False)
    torch.testing.assert_close(fast(x), peft_layer.base_layer(x))


@pytest.mark.parametrize("config", [{"lora_dropout": 0.1}, {"use_dora": True}])
def test_layers_the_short_form_is_not_exact_for_keep_peft(config):
    peft_layer, fast = _layers(**config)
    assert type(fast) is LoraLinear


def test_add_adapters_gives_plain_lora_layers_the_fast_forward(tiny_config):
    layers = lora.adapter_layers(build(tiny_config, "{rank: 2, alpha: 1, targets: [attn, conv]}"))
    attn = [layer for name, layer in layers.items() if ".attn" in name]
    convs = [layer for layer in layers.values() if isinstance(layer.base_layer, nn.Conv2d)]
    assert len(attn) >= 8 and convs
    assert all(type(layer) is lora_fast.FastLoraLinear for layer in attn)
    assert not any(isinstance(layer, lora_fast.FastLoraLinear) for layer in convs)  # peft's
