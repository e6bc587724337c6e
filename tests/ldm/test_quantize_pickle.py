"""An int8 / nf4 base survives pickle, torch.save and deepcopy (Lightning's ddp_spawn pickles the
LightningModule to its processes; users `torch.save(model)`): the copy computes as the original,
to the bit, on its own tensors, and writes the same state dict."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from ldm import quantize

pytest.importorskip("bitsandbytes")

KINDS = ["int8", "nf4"]


def quantized_model(kind: str, lora: bool, seed: int = 0) -> nn.Sequential:
    """Two quantized Linears, plain or as the base layers of a peft LoRA (how a run holds its
    base: adapters injected into the plain model, then its frozen layers quantized)."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    if lora:  # nonzero B: the adapters change the output
        config = LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False)
        inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    assert quantize.quantize_frozen(model, kind, torch.float32) == 2
    return model


def base_layers(model: nn.Sequential) -> list[nn.Module]:
    return [getattr(model[i], "base_layer", model[i]) for i in (0, 2)]


def copied(model: nn.Module, how: str) -> nn.Module:
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return copy.deepcopy(model)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_computes_as_the_original_on_its_own_tensors(kind, how, lora):
    model = quantized_model(kind, lora)
    x = torch.randn(5, 64)
    before = model(x)
    twin = copied(model, how)
    assert [type(m) for m in base_layers(twin)] == [type(m) for m in base_layers(model)]
    assert torch.equal(twin(x), before)
    # the same state dict: the same keys, the same tensors, to the bit
    ours, theirs = model.state_dict(), twin.state_dict()
    assert list(theirs) == list(ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key
    # the copy's forward reads the copy's weights: zeroed there, only its output changes
    with torch.no_grad():
        for layer in base_layers(twin):
            layer.weight.data.zero_()
    assert not torch.equal(twin(x), before)
    assert torch.equal(model(x), before)
    if lora:  # and its backward reaches the copy's adapters, not the original's
        twin(x).sum().backward()
        assert all(p.grad is not None for n, p in twin.named_parameters() if "lora_" in n)
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_an_int8_copy_saves_and_loads_its_own_state_dict(how):
    """int8's own `_save_to_state_dict` / `_load_from_state_dict` (the scales as `SCB`) act on
    the copy: another model's state dict loaded into it is what it then computes and saves."""
    model, other = quantized_model("int8", lora=True), quantized_model("int8", lora=True, seed=1)
    x = torch.randn(5, 64)
    before = model(x)
    twin = copied(model, how)
    twin.load_state_dict(other.state_dict())
    assert torch.equal(twin(x), other(x))
    assert torch.equal(
        twin.state_dict()["0.base_layer.SCB"], other.state_dict()["0.base_layer.SCB"]
    )
    assert torch.equal(model(x), before)
    assert not torch.equal(
        model.state_dict()["0.base_layer.SCB"], twin.state_dict()["0.base_layer.SCB"]
    )
