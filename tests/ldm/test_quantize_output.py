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
