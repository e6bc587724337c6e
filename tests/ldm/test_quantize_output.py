"""An int8 / nf4 / fp8 base layer's output is an ordinary tensor: the blocks add the residual into
it in place (`ff(x).add_(x)`), which autograd forbids on a view made inside an autograd Function
(bitsandbytes' matmuls; our fp8 one, whose F.linear returns a 3-d input's output as a view)."""

import pytest
import torch
from torch import nn

from ldm.quantize import dequantize, quantized_layer


@pytest.mark.parametrize("kind", ["int8", "nf4", "fp8"])
def test_a_quantized_layers_output_takes_an_in_place_residual_and_backward(kind):
    if kind != "fp8":
        pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = nn.Linear(64, 64).requires_grad_(False)
    layer = quantized_layer(linear, kind, torch.float32)
    x = torch.randn(2, 5, 64, requires_grad=True)  # (B, N, C) as in a transformer block
    out = layer(x).add_(x)
    out.sum().backward()
    # d/dx sum(W x + b + x) = the column sums of W (as stored: dequantized) + 1
    expected = dequantize(layer).float().sum(0) + 1
    torch.testing.assert_close(x.grad[0, 0], expected, rtol=1e-4, atol=1e-4)


def test_int8_hands_bitsandbytes_quantizer_a_row_major_input(monkeypatch):
    """bitsandbytes' CUDA int8 quantizer reads its input by data pointer as row-major; a permuted
    input (SpatialTransformer's proj_in at batch 1: a strided view through reshape and .to())
    would be read as other rows there. The CPU kernel takes any strides, so the check is on
    what reaches it."""
    bnb = pytest.importorskip("bitsandbytes")
    real = bnb.functional.int8_vectorwise_quant
    seen = []

    def row_major_only(A, threshold=0.0):
        seen.append(A.is_contiguous())
        return real(A, threshold=threshold)

    torch.manual_seed(0)
    layer = quantized_layer(nn.Linear(64, 32).requires_grad_(False), "int8", torch.float32).eval()
    monkeypatch.setattr(bnb.functional, "int8_vectorwise_quant", row_major_only)
    x = torch.randn(1, 64, 4, 4).flatten(2).transpose(1, 2)  # (1, 16 tokens, 64): channels last
    assert not x.reshape(-1, 64).is_contiguous()  # the case: a view with the permuted strides
    out = layer(x)
    assert seen == [True]
    torch.testing.assert_close(out, layer(x.contiguous()), rtol=0, atol=0)
