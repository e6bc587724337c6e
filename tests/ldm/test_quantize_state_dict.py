"""A quantized layer loads a state dict of its own format: what Lightning's resume does with a
LoRA run's base (`ldm.lora.checkpoints.load_layout` puts the model's own quantized tensors in the
checkpoint's place, then the module loads it strictly)."""

from pathlib import Path

import pytest
import torch
from lora_helpers import build, unet_output
from torch import nn

from ldm import lora
from ldm.quantize import quantized_layer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"


def nf4_of(weight: torch.Tensor) -> nn.Module:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
    linear.weight.data.copy_(weight)
    return quantized_layer(linear, "nf4", torch.float32)


@pytest.mark.parametrize("other", ["twice", "unrelated"])
def test_an_nf4_layer_loads_an_nf4_state_dict_quant_state_and_all(other):
    """Twice the weight is the same nf4 bits and block codes with twice the second level's
    scales and offset; an unrelated weight differs in every part: only a load that takes the
    whole quant state gives the source's output."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    weight = torch.randn(32, 256)
    source = nf4_of(2 * weight if other == "twice" else torch.randn(32, 256))
    target = nf4_of(weight)
    x = torch.randn(3, 256)
    assert not torch.allclose(target(x), source(x))
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_an_nf4_state_dict_of_another_shape_is_refused_by_name():
    pytest.importorskip("bitsandbytes")
    state = nf4_of(torch.randn(32, 128)).state_dict()
    with pytest.raises(RuntimeError, match=r"weight: an nf4 state of \(\(32, 128\)"):
        nf4_of(torch.randn(64, 64)).load_state_dict(state)


@pytest.mark.parametrize("kind", ["nf4", "int8", "fp8"])
def test_a_lora_checkpoint_resumes_onto_the_runs_quantized_base(kind):
    """save_layout (the plain base in the file) then load_layout and a strict load into a fresh
    model quantized the same way, as `--resume` does: the adapters come back, the base stays
    the run's own quantized tensors."""
    if kind != "fp8":
        pytest.importorskip("bitsandbytes")
    settings = "{rank: 2, alpha: 4}"
    model = build(TINY, settings)
    lora.quantize_base(model, kind, torch.float32)
    with torch.no_grad():  # trained adapters, so that the load has something to restore
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.3)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    fresh = build(TINY, settings)  # the same base file: its quantized tensors equal the run's
    lora.quantize_base(fresh, kind, torch.float32)
    assert not torch.equal(unet_output(fresh), unet_output(model))
    lora.load_layout(fresh, saved)
    fresh.load_state_dict(saved["state_dict"], strict=True)
    torch.testing.assert_close(unet_output(fresh), unet_output(model), rtol=0, atol=0)
