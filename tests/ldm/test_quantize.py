"""A quantized frozen base (ldm.quantize): each format's layer output stays within that format's
error bound computed here from its definition (not from our code), gradients reach the adapters
and not the base, and the whole backbones of every family quantize and still run."""

import pytest
import torch
from torch import nn

from ldm import quantize

# QLoRA (arXiv:2305.14314) Appendix E: the 16 NF4 levels on [-1, 1].
NF4_LEVELS = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def layer_and_input(seed=0, n_in=128, n_out=48):
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out).requires_grad_(False)
    with torch.no_grad():  # rows of very different scales: a per-tensor scale would fail them
        layer.weight.mul_(torch.logspace(-2, 1, n_out)[:, None])
    return layer, torch.randn(6, n_in)


def output_error_bound(x, weight_error_bound):
    """|y - y_exact| <= sum_j |x_j| * max|dW_ij| (the input exact, fp32 compute)."""
    return x.abs() @ weight_error_bound.t()


def test_fp8_output_within_the_e4m3_rounding_bound():
    layer, x = layer_and_input()
    w = layer.weight
    # e4m3: 3 mantissa bits, relative step 2^-3, so round-to-nearest errs by <= 2^-4 relative for
    # normal values; below 2^-6 (subnormal) the absolute step is 2^-9: error <= 2^-10. In units
    # of the scale s = row absmax / 448.
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    bound = 2**-4 * w.abs() + 2**-10 * scale
    quantized = quantize.Fp8Linear(layer)
    error = (quantized(x) - layer(x)).abs()
    assert (error <= output_error_bound(x, bound) + 1e-6).all()
    assert quantized.weight.dtype == torch.uint8 and quantized.weight.view(quantize.FP8).dtype
    # and it is a real rounding, not the identity: e4m3 cannot hold most fp32 values
    assert error.max() > 0


def test_fp8_conv_within_the_bound_and_the_module_cast_keeps_the_bytes():
    torch.manual_seed(1)
    conv = nn.Conv2d(8, 6, 3, padding=1).requires_grad_(False)
    x = torch.randn(2, 8, 5, 5)
    quantized = quantize.Fp8Conv2d(conv)
    w = conv.weight
    scale = w.abs().amax(dim=(1, 2, 3), keepdim=True) / 448
    bound = (2**-4 * w.abs() + 2**-10 * scale).amax(dim=(2, 3))  # per (out, in), any tap
    # each output sums in_ch * 9 products: bound with the largest |x| of each channel
    xmax = x.abs().amax(dim=(2, 3))  # (B, in)
    limit = (xmax @ bound.t() * 9)[:, :, None, None]
    assert ((quantized(x) - conv(x)).abs() <= limit + 1e-6).all()
    before = quantized.weight.clone()
    quantized.to(torch.bfloat16)  # Lightning's bf16-true: the fp8 bytes must not be cast
    assert torch.equal(quantized.weight, before)


def fp8_twins(kind: str):
    """An fp8 Linear / Conv2d (no bias: a module cast rounds a bias, not the point here) and an
    fp32 input; scales far from bf16's grid (absmax / 448 of random rows)."""
    torch.manual_seed(2)
    if kind == "linear":
        layer, x = nn.Linear(64, 48, bias=False), torch.randn(4, 64)
        return quantize.Fp8Linear(layer.requires_grad_(False)), layer, x
    layer, x = nn.Conv2d(8, 6, 3, padding=1, bias=False), torch.randn(2, 8, 5, 5)
    return quantize.Fp8Conv2d(layer.requires_grad_(False)), layer, x


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_fp8_scales_stay_fp32_through_a_bf16_cast_of_the_module(kind):
    """Lightning's `precision: bf16-true` converts the model with `.to(bfloat16)`: the fp8 bytes
    and their per-channel fp32 scales are storage, not values to round (a bf16 scale errs by up
    to 2^-9 on every weight of its channel). The layer computes after the cast what it did
    before, to the bit, and its state dict is the one before."""
    fp8, _, x = fp8_twins(kind)
    before, state = fp8(x), {k: v.clone() for k, v in fp8.state_dict().items()}
    scale = state["weight_scale"]
    assert not torch.equal(scale.bfloat16().float(), scale)  # a cast of them would round
    fp8.to(torch.bfloat16)
    assert torch.equal(fp8(x), before)
    after = fp8.state_dict()
    assert list(after) == list(state)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_fp8_state_dict_is_the_bytes_and_fp32_scales_and_loads_across_a_bf16_cast(kind):
    """The state dict's fp8 entries, from their definition: `weight` the e4m3 bytes of W / s,
    `weight_scale` s = per-channel absmax / 448 in fp32, shaped to broadcast over W - the keys
    and dtypes checkpoints and fp8 files always held. One saved before a `.to(bfloat16)` loads
    after it and the reverse (strict), and the loaded layer computes as the one it came from."""
    source, layer, x = fp8_twins(kind)
    w = layer.weight.float()
    dims = tuple(range(1, w.dim()))
    scale = w.abs().amax(dim=dims, keepdim=True) / 448
    state = source.state_dict()
    assert sorted(state) == ["weight", "weight_scale"]
    assert state["weight_scale"].dtype == torch.float32 and torch.equal(
        state["weight_scale"], scale
    )
    fp8_bytes = (w / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert state["weight"].dtype == torch.uint8 and torch.equal(state["weight"], fp8_bytes)
    for cast_source in (False, True):  # saved before the cast, loaded after; and the reverse
        source, _, _ = fp8_twins(kind)
        target, _, _ = fp8_twins(kind)
        with torch.no_grad():
            target.weight.zero_(), target.weight_scale.fill_(1.0)  # nothing of the source
        (source if cast_source else target).to(torch.bfloat16)
        target.load_state_dict(source.state_dict())
        assert torch.equal(target(x), source(x))


def test_int8_output_within_the_llm_int8_bound():
    pytest.importorskip("bitsandbytes")
    layer, x = layer_and_input()
    w = layer.weight
    # LLM.int8 (arXiv:2208.07339, Sec. 3): W row-wise and X row-wise absmax quantized to
    # [-127, 127]: |dW_ij| <= absmax_i / 254, |dx_j| <= absmax(x) / 254 (inputs over the 6.0
    # outlier threshold stay 16-bit, which only makes it smaller).
    dw = w.abs().amax(dim=1, keepdim=True) / 254 * torch.ones_like(w)
    dx = x.abs().amax(dim=1, keepdim=True) / 254
    bound = x.abs() @ dw.t() + dx * (w.abs() + dw).sum(dim=1)[None]
    quantized = quantize.quantized_layer(layer, "int8", torch.float32)
    assert quantized.weight.dtype == torch.int8
    error = (quantized(x) - layer(x)).abs()
    assert (error <= bound * 1.01 + 1e-5).all()
    assert error.max() > 0


def test_nf4_output_within_the_nf4_bound():
    pytest.importorskip("bitsandbytes")
    layer, x = layer_and_input()
    w = layer.weight
    # NF4: blocks of 64 consecutive values scaled by their absmax c onto the 16 levels: error
    # <= half the widest gap times c. Double quantization stores c itself in 8 bits (the
    # dynamic map, blocks of 256 absmax values, QLoRA Sec. 3): at the top of its range the map's
    # step is 2^-4 of the group's largest c, so c errs by up to 2^-5 of max c.
    half_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2
    blocks = w.reshape(-1, quantize.NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    dw = (absmax * half_gap + 2**-5 * absmax.max()).expand_as(blocks)
    quantized = quantize.quantized_layer(layer, "nf4", torch.float32)
    assert quantized.weight.numel() == w.numel() // 2  # two values a byte
    error = (quantized(x) - layer(x)).abs()
    assert (error <= output_error_bound(x, dw.reshape(w.shape)) + 1e-5).all()
    assert error.max() > 0


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
def test_gradients_reach_the_adapters_and_not_the_base(kind):
    if kind != "fp8":
        pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"]), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    for name, p in model.named_parameters():  # nonzero B: gradients reach A too
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    assert quantize.quantize_frozen(model, kind, torch.float32) == 2
    assert all(quantize.is_quantized(model[i].base_layer) for i in (0, 2))
    model(torch.randn(5, 64)).square().sum().backward()
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapters) == 4 and all("lora_" in n for n in adapters)  # A, B of both layers
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert not any(b.requires_grad for b in model.buffers())


def tiny_backbones():
    from ldm.dit import DiT
    from ldm.flux import Flux
    from ldm.mmdit import MMDiT
    from ldm.unet import UNetModel

    unet = UNetModel(
        image_size=8, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[2],
        num_res_blocks=1, channel_mult=[1, 2], num_heads=2, use_spatial_transformer=True,
        transformer_depth=1, context_dim=32,
    )  # fmt: skip
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 500])
    return {
        "sd-unet": (unet, lambda m: m(x, t, context=torch.randn(2, 5, 32))),
        "dit": (
            DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4),
            lambda m: m(x, t, {"y": torch.tensor([0, 1])}),
        ),
        "mmdit": (
            MMDiT(depth=2, hidden_size=64, num_heads=2, in_channels=4, context_dim=24,
                  pooled_dim=16, pos_embed_max_size=8, sample_size=8),
            lambda m: m(x, t.float(), {"crossattn": torch.randn(2, 5, 24),
                                       "vector": torch.randn(2, 16)}),
        ),
        "flux": (  # one block of each kind, as configs/flux/tiny.yaml
            Flux(depth=1, depth_single_blocks=1, hidden_size=32, num_heads=2, axes_dim=(4, 6, 6),
                 in_channels=4, context_dim=24, pooled_dim=16, guidance=3.5),
            lambda m: m(x, t.float(), {"crossattn": torch.randn(2, 5, 24),
                                       "vector": torch.randn(2, 16)}),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["sd-unet", "dit", "mmdit", "flux"])
def test_every_family_quantizes_to_fp8_like_a_3_bit_mantissa(family):
    """The blocks' layers in fp8 err like weights rounded to 3 mantissa bits: about 2^4 times
    the error of the same weights rounded to bf16's 7 bits (computed here by plain casts)."""
    import copy

    from ldm.block_swap import blocks_of
    from ldm.lora import quantize_blocks

    backbone, run = tiny_backbones()[family]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in backbone.parameters():  # past the zero inits, which would hide everything
            p.add_(0.05 * torch.randn_like(p))
    backbone.requires_grad_(False).eval()

    def output(model):
        torch.manual_seed(1)
        with torch.no_grad():
            return run(model)

    expected = output(backbone)
    rounded = copy.deepcopy(backbone)
    layers = [
        m for b in blocks_of(rounded) for m in b.modules() if type(m) in (nn.Linear, nn.Conv2d)
    ]
    for layer in layers:
        layer.weight.data = layer.weight.data.bfloat16().float()
    bf16_error = (output(rounded) - expected).norm()
    assert quantize_blocks(backbone, "fp8", torch.float32) == len(layers) > 0
    fp8_error = (output(backbone) - expected).norm()
    assert 2**2 < fp8_error / bf16_error < 2**6, (fp8_error / bf16_error).item()


def test_unsupported_names_what_to_do():
    assert quantize.unsupported("fp8", torch.device("cpu")) is None
    why = quantize.unsupported("int8", torch.device("meta"))
    assert why is not None and why.startswith("int8 does not run on meta")


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
def test_dequantize_gives_the_weight_within_its_format_bound(kind):
    """What checkpoints hold (ldm.lora.save_layout): each weight within its format's step."""
    if kind != "fp8":
        pytest.importorskip("bitsandbytes")
    layer, _ = layer_and_input()
    w = layer.weight
    rows = w.abs().amax(dim=1, keepdim=True)
    if kind == "fp8":
        bound = 2**-4 * w.abs() + 2**-10 * rows / 448
    elif kind == "int8":
        # one step of absmax / 127 (round-to-nearest would halve it; the CPU backend scales
        # in reduced precision and misses half a step by up to ~8 %)
        bound = (rows / 127).expand_as(w)
    else:
        half_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2
        blocks = w.reshape(-1, quantize.NF4_BLOCK).abs().amax(dim=1, keepdim=True)
        bound = (blocks * half_gap + 2**-5 * blocks.max()).expand(-1, 64).reshape(w.shape)
    quantized = quantize.quantized_layer(layer, kind, torch.float32)
    quantized(torch.randn(2, w.shape[1]))  # after a forward too (bitsandbytes moves its state)
    got = quantize.dequantize(quantized)
    assert got.shape == w.shape and got.dtype == torch.float32
    assert ((got - w).abs() <= bound * 1.001 + 1e-7).all()


def test_int8_dequantize_is_the_weight_its_forward_and_backward_compute_with():
    """What a checkpoint holds of an int8 layer is the weight it trained with, to the bit: read
    from the layer's own passes (no bias, training on the CPU: bitsandbytes' dequantizing path),
    x = I gives I W^T and a gradient of I gives I W, each product exact."""
    pytest.importorskip("bitsandbytes")
    layer, _ = layer_and_input(seed=3)
    layer.bias = None
    quantized = quantize.quantized_layer(layer, "int8", torch.float32).train()
    eye = torch.eye(layer.in_features, requires_grad=True)
    out = quantized(eye)
    out.backward(torch.eye(layer.in_features, layer.out_features))  # grad x row i: W row i
    got = quantize.dequantize(quantized)
    assert torch.equal(got, out.detach().t())
    assert torch.equal(got, eye.grad[: layer.out_features])
    assert got.unique().numel() > 1000  # random rows of many scales, not a few round values


def fp8_and_dequantized_twins(kind, dtype):
    """A LoRA on an fp8 base layer and the same LoRA on a plain layer holding that base's
    dequantized weight (the reference: what autograd does with a full-precision weight)."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    if kind == "linear":
        layer, x = nn.Linear(96, 40), torch.randn(3, 5, 96)
    else:
        layer, x = nn.Conv2d(6, 10, 3, padding=1), torch.randn(2, 6, 8, 8)
    plain = nn.Sequential(layer.requires_grad_(False))
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"], init_lora_weights=False), plain)
    fp8 = copy.deepcopy(plain)
    assert quantize.quantize_frozen(fp8, "fp8", dtype) == 1
    fp8.to(dtype), plain.to(dtype)
    plain[0].base_layer.weight.data = fp8[0].base_layer.dequantized(dtype)
    for model in (fp8, plain):  # a bias that trains (peft's `bias="all"`) gets its gradient
        model[0].base_layer.bias.requires_grad_(True)
    return (fp8, plain), x.to(dtype), layer.weight.shape


def saved_during_forward_and_backward(model, x):
    """The tensors autograd saves for the backward, and the gradients of the input and the
    adapters."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    out.float().square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return saved, x.grad, grads


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_backward_holds_only_the_fp8_weight_and_gives_the_dequantized_gradients(kind, dtype):
    (fp8, plain), x, shape = fp8_and_dequantized_twins(kind, dtype)
    saved, grad_x, grads = saved_during_forward_and_backward(fp8, x)
    saved_plain, grad_x_plain, grads_plain = saved_during_forward_and_backward(plain, x)

    def full_precision_weights(found):  # the weight, or its transpose (linear's x W^T)
        return [s for s in found if sorted(s[0]) == sorted(shape) and s[1].is_floating_point]

    # the plain layer keeps its weight for the input's gradient (what the check would see) ...
    assert [dtype] == [s[1] for s in full_precision_weights(saved_plain)]
    # ... the fp8 one only its fp8 bytes (uint8) and scales
    assert full_precision_weights(saved) == []
    assert (tuple(shape), torch.uint8) in saved
    assert sorted(grads) == sorted(grads_plain) and len(grads) == 3  # lora_A, lora_B, bias
    torch.testing.assert_close(grad_x, grad_x_plain, rtol=0, atol=0)
    for name in grads:  # the bias's sum over positions may add in another order
        exact = {} if name.endswith("bias") else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(grads[name], grads_plain[name], **exact)
