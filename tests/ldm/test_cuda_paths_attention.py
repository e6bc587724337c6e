"""`ldm.attention.preferring`, the SDPA kernel choice of `attention_kernels`: what it sets is
what CUDA's kernel selection reads (its priority order and enabled kernels), checked here on the
CPU."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ldm.attention import preferring


def test_kernels_are_tried_in_the_order_given():
    # PyTorch's own order puts flash before cuDNN: a plain sdpa_kernel([cudnn, flash]) runs flash
    # wherever flash can, so cuDNN would never be measured or used.
    with preferring([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        order = torch._C._get_sdp_priority_order()
        assert order[:3] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION), 0]
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()  # not asked for
    assert torch.backends.cuda.mem_efficient_sdp_enabled()  # restored on exit


def test_attention_no_named_kernel_takes_falls_back_to_math():
    # As float32 attention under [cudnn, flash] on CUDA (sampling outside autocast, SD 2's
    # upcast): here cuDNN cannot run on the CPU at all, so only the math fallback can answer.
    q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
    with preferring([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_the_models_attention_kernels_are_preferred_in_order_with_math_last():
    """LatentDiffusion.apply_model runs the backbone under `preferring`: on CUDA, float32
    attention (sampling outside autocast) under `attention_kernels: flash` falls back to math
    instead of failing with "No available kernel"."""
    from test_speed_options import model_inputs, tiny_model

    model = tiny_model(attention_kernels=["flash"])
    seen = []
    model.model.register_forward_pre_hook(
        lambda *_: seen.append(
            (torch._C._get_sdp_priority_order()[:2], torch.backends.cuda.math_sdp_enabled())
        )
    )
    with torch.no_grad():
        model.apply_model(*model_inputs(model))
    assert seen == [([int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.MATH)], True)]
