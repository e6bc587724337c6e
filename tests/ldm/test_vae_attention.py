"""The VAE's attention block: the original CompVis formula's outputs, without its HW x HW matrix."""

import pytest
import torch

from ldm.autoencoder import AttnBlock
from lun.memory_probe import peak_allocated


def compvis_attention(block: AttnBlock, x: torch.Tensor) -> torch.Tensor:
    """CompVis `ldm.modules.diffusionmodules.model.AttnBlock.forward`, as written there."""
    h_ = block.norm(x)
    q, k, v = block.q(h_), block.k(h_), block.v(h_)
    b, c, h, w = q.shape
    q = q.reshape(b, c, h * w).permute(0, 2, 1)  # b, hw, c
    k = k.reshape(b, c, h * w)  # b, c, hw
    w_ = torch.bmm(q, k) * (int(c) ** (-0.5))  # b, hw, hw
    w_ = torch.nn.functional.softmax(w_, dim=2)
    v = v.reshape(b, c, h * w)
    h_ = torch.bmm(v, w_.permute(0, 2, 1)).reshape(b, c, h, w)
    return x + block.proj_out(h_)


def random_block(channels: int, seed: int = 0) -> AttnBlock:
    """Every weight non-zero and of ordinary size (a zero-initialised proj_out would hide
    everything the attention does)."""
    torch.manual_seed(seed)
    block = AttnBlock(channels)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block.eval()


@pytest.mark.parametrize("shape", [(2, 32, 8, 8), (1, 64, 5, 7), (3, 32, 1, 16)])
def test_outputs_equal_the_original_formula(shape):
    block = random_block(shape[1])
    x = torch.randn(shape) * 2
    with torch.no_grad():
        ours, theirs = block(x), compvis_attention(block, x)
    assert (ours - x).abs().mean() > 0.1  # the attention branch contributes
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_gradients_equal_the_original_formula():
    block = random_block(32, seed=1)
    x = torch.randn(2, 32, 6, 6, requires_grad=True)
    (block(x) ** 2).sum().backward()
    ours = x.grad.clone(), [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    (compvis_attention(block, x) ** 2).sum().backward()
    torch.testing.assert_close(ours[0], x.grad, rtol=1e-4, atol=1e-4)
    for mine, original in zip(ours[1], [p.grad for p in block.parameters()]):
        torch.testing.assert_close(mine, original, rtol=1e-4, atol=1e-4)


def test_large_images_never_hold_the_hw_by_hw_matrix():
    """64 x 64 positions: the logits alone would be 4096^2 float32 = 64 MiB; the block's whole
    peak stays under a quarter of that (activations of this size are 0.5 MiB each)."""
    block = random_block(32)
    x = torch.randn(1, 32, 64, 64)
    logits = (64 * 64) ** 2 * 4
    with torch.no_grad():
        peak = peak_allocated(lambda: block(x), torch.device("cpu"))
        original = peak_allocated(lambda: compvis_attention(block, x), torch.device("cpu"))
    assert original > logits  # the measure sees the matrix where there is one
    assert peak < logits / 4, f"{peak / 2**20:.1f} MiB"
