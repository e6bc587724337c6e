"""An int8 base layer's output is an ordinary tensor: the blocks add the residual into it in
place (`ff(x).add_(x)`), which autograd forbids on a view made inside bitsandbytes' Function."""

import pytest
import torch
from torch import nn

from ldm.quantize import quantized_layer


def test_an_int8_layers_output_takes_an_in_place_residual_and_backward():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = nn.Linear(64, 64).requires_grad_(False)
    layer = quantized_layer(linear, "int8", torch.float32)
    x = torch.randn(2, 5, 64, requires_grad=True)  # (B, N, C) as in a transformer block
    out = layer(x).add_(x)
    out.sum().backward()
    # d/dx sum(W x + b + x) = sum over output rows of W (the int8 one), + 1
    torch.testing.assert_close(x.grad[0, 0], linear.weight.sum(0) + 1, rtol=0.02, atol=0.02)
