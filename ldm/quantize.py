"""A quantized frozen base for LoRA: the backbone's frozen Linear (and, for fp8, Conv2d) weights
stored in int8, nf4 or fp8, the adapters on top in bf16/fp32.

- int8: LLM.int8 (Dettmers et al. 2022, arXiv:2208.07339), bitsandbytes' `Linear8bitLt`: each
  output row scaled by its absmax to [-127, 127] (1 byte a value, one fp32 scale a row).
- nf4: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, arXiv:2305.14314), bitsandbytes'
  `Linear4bit`: blocks of 64 values scaled by their absmax onto 16 levels (half a byte a value);
  the absmax values themselves quantized to 8 bits in blocks of 256 ("double quantization").
- fp8: the weight as float8_e4m3fn (1 byte: 4 exponent, 3 mantissa bits, largest 448) with one
  fp32 scale per output channel, upcast to the compute dtype in the forward. Any device that can
  cast to float8 stores it (the matmul itself runs in bf16/fp32, so no fp8 tensor cores needed).

The layers keep their module names, and peft's LoRA layers keep theirs: only a LoRA layer's
`base_layer` (or a frozen layer without adapters) is replaced, so adapter files are the same
whatever the base's quantization. Quantize after the base weights are loaded: this is the
training-time form of the base, made at fit start (`ldm.lora.hold_base_for_training`).
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("none", "int8", "nf4", "fp8", "auto")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
NF4_BLOCK = 64  # bitsandbytes' Linear4bit default blocksize


class Fp8Storage(nn.Module):
    """Common part of the fp8 layers: `weight` held as float8_e4m3fn bits (a uint8 buffer, so
    that a module-wide `.to(bf16)` - Lightning's true precision, `hold_frozen_in` - leaves the
    bytes alone) with one fp32 scale per output channel: W ~ fp8(W / s) * s, s = absmax / 448.
    The scales likewise as their int32 bits (`weight_scale_bits`, not persistent): such a cast
    would round them to bf16, an error of up to 2^-9 on every weight of a channel. The state
    dict holds them as `weight_scale`, fp32, as ever (`_save_to_state_dict`,
    `_load_from_state_dict`), so checkpoints and files are the same."""

    def _store(self, weight: torch.Tensor, device: torch.device | None) -> None:
        """The scale and the cast computed on `device` (None: where `weight` is), the result
        kept where `weight` is."""
        self.stored_dtype = weight.dtype  # what a checkpoint holds it as (`dequantize`)
        w = weight.detach().to(weight.device if device is None else device).float()
        amax = (
            w.reshape(w.shape[0], -1).abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        )
        scale = (amax / FP8_MAX).reshape(-1, *[1] * (w.dim() - 1))
        home = weight.device
        self.register_buffer("weight", (w / scale).to(FP8).view(torch.uint8).to(home))
        self.register_buffer("weight_scale_bits", scale.to(home).view(torch.int32), False)

    @property
    def weight_scale(self) -> torch.Tensor:
        """The fp32 scales as stored (their host copy while block swap holds the layer)."""
        return stored(self, "weight_scale_bits").view(torch.float32)

    def _scales_here(self) -> torch.Tensor:
        """The fp32 scales where the layer is now (what the forward computes with)."""
        return self.weight_scale_bits.view(torch.float32)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight_scale"] = self.weight_scale

    def _load_from_state_dict(self, state, prefix, metadata, strict, missing, unexpected, errors):
        super()._load_from_state_dict(state, prefix, metadata, strict, missing, unexpected, errors)
        key = prefix + "weight_scale"
        if key in unexpected:  # not a buffer of the module's own: its bits are
            unexpected.remove(key)
        if key not in state:
            if strict:
                missing.append(key)
        elif state[key].shape != self.weight_scale.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(state[key].shape)}"
                f" from checkpoint, the shape in current model is {tuple(self.weight_scale.shape)}."
            )
        else:
            with torch.no_grad():  # into the stored bits (block swap: the host copy)
                self.weight_scale.copy_(state[key])

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (fp8 -> fp32 is exact; the scale multiplies in fp32)."""
        return _dequantize(stored(self, "weight"), self.weight_scale, dtype)

    @staticmethod
    def compute_dtype(x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype


def stored(layer: nn.Module, name: str) -> torch.Tensor:
    """The layer's frozen tensor `name` as stored: its host copy while block swap holds the
    layer's block (`ldm.block_swap`: off the device the layer has an empty placeholder)."""
    from ldm.block_swap import host_copy

    host = host_copy(layer, name)
    return host if host is not None else getattr(layer, name)


def _dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (bits.view(FP8).float() * scale.float()).to(dtype)


class _Fp8Op(torch.autograd.Function):
    """y = op(x, W) with W = dequantized fp8 bits; the backward dequantizes W again instead of
    autograd keeping the forward's full-precision copy for the input's gradient (x W^T's
    gradient is grad W): the point of fp8 storage is not to hold the bf16 weight - only the
    fp8 bytes and their scales are saved. The frozen W gets no gradient; a bias that trains does.
    `op` is "linear" or a Conv2d's (stride, padding, dilation, groups)."""

    @staticmethod
    def forward(ctx, x, bits, scale, bias, dtype, conv):
        ctx.save_for_backward(bits, scale)
        ctx.dtype, ctx.conv, ctx.input_shape = dtype, conv, x.shape
        weight = _dequantize(bits, scale, dtype)
        if conv is None:
            return F.linear(x, weight, bias)
        return F.conv2d(x, weight, bias, *conv)

    @staticmethod
    def backward(ctx, grad):
        bits, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = _dequantize(bits, scale, ctx.dtype)
            if ctx.conv is None:
                grad_x = grad @ weight  # (..., out) @ (out, in)
            else:
                grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, weight, grad, *ctx.conv)
        if ctx.needs_input_grad[3]:
            dims = (0, 2, 3) if ctx.conv is not None else tuple(range(grad.dim() - 1))
            grad_bias = grad.sum(dims)
        return grad_x, None, None, grad_bias, None, None


class Fp8Linear(Fp8Storage):
    """A frozen nn.Linear with fp8 storage; output in the input's dtype (or autocast's)."""

    def __init__(self, linear: nn.Linear, device: torch.device | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._store(linear.weight, device)
        self.bias = linear.bias  # frozen, small: kept as it was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        # 2-d through the Function: F.linear returns a 3-d input's output as a view, and a view
        # made inside an autograd Function may not be modified in place (the blocks'
        # `ff(x).add_(x)`); the reshape back outside it is an ordinary view, and costs no copy
        rows = x.to(dtype).reshape(-1, self.in_features)
        out = _Fp8Op.apply(rows, self.weight, self._scales_here(), bias, dtype, None)
        return out.view(*x.shape[:-1], self.out_features)


class Fp8Conv2d(Fp8Storage):
    """A frozen nn.Conv2d (zero padding) with fp8 storage, its kernel scaled per output channel."""

    def __init__(self, conv: nn.Conv2d, device: torch.device | None = None):
        super().__init__()
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self._store(conv.weight, device)
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        conv = (self.stride, self.padding, self.dilation, self.groups)
        return _Fp8Op.apply(x.to(dtype), self.weight, self._scales_here(), bias, dtype, conv)


def _bind(layer: nn.Module, **methods) -> None:
    """Our `methods` in place of bitsandbytes' on this one layer, which stays a Linear8bitLt /
    Linear4bit by type: peft wraps a base layer by `isinstance` (its bnb dispatch) and by class
    name (DoRA's `Linear4bit` check), and `_kind_of`, the memory plan and the tools find the
    format by the class name. Each a `functools.partial` of a module-level function and the
    layer, not a `types.MethodType`, which pickle reduces to `getattr(layer, function name)`,
    an attribute the layer lacks (`pickle.dumps`, `torch.save(model)` and Lightning's
    ddp_spawn failed): pickle and deepcopy rebuild a partial from the function's name and the
    layer through their memo, so that a copy's forward runs on the copy's tensors."""
    for name, function in methods.items():
        setattr(layer, name, functools.partial(function, layer))


def _int8_weight(rows: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = CB * SCB / 127 in `dtype` (LLM.int8's row-wise absmax scale), in bitsandbytes' own
    expression, CB * (SCB * (1/127)) (autograd/_functions.py, MatMul8bitFp's forward and both
    backwards), so that our forward and backward give its values to the bit; and `dequantize`
    (what checkpoints hold) the weight they compute with: (CB * SCB) / 127 differs in the last
    bit of about a quarter of the values."""
    return rows.to(dtype, copy=True).mul_(scales.unsqueeze(1).mul(1.0 / 127.0))


class _Int8Op(torch.autograd.Function):
    """y = x W^T + b on the int8 rows and their scales, as bitsandbytes' `bnb.matmul` computes it
    for a frozen Linear8bitLt: training on the CPU / XPU, its MatMul8bitFp (W dequantized, then a
    matmul); otherwise its MatMul8bitLt, LLM.int8 (arXiv:2208.07339, Sec. 3.2-3.4): the input
    quantized row-wise to int8 except the columns with a value past `threshold`, which stay in
    16 bits (the outlier decomposition), through bitsandbytes' own kernels. Used instead of those,
    which keep the input (and its outlier columns) on the autograd context (`ctx.tensors`, `ctx.A`)
    rather than in the saved tensors: activation checkpointing cannot drop them then, and every
    int8 layer of a swapped block held its input from the forward to the backward (`ldm.block_swap`).
    The frozen W needs no gradient, so its input is not needed at all: only the rows and the scales
    are saved, and the backward dequantizes them again (grad_x = grad_y W), as bitsandbytes'."""

    @staticmethod
    def forward(ctx, x, rows, scales, bias, threshold, dequantize):
        import bitsandbytes as bnb

        ctx.save_for_backward(rows, scales)
        ctx.dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        if dequantize:
            return F.linear(x, _int8_weight(rows, scales, x.dtype), bias)
        # Row-major, as the CUDA kernel reads it by data pointer (backends/cuda/ops.py,
        # `cint8_vector_quant`): a permuted input (SpatialTransformer's proj_in at batch 1)
        # keeps its strides through the reshape and .to(), and would be read as other rows.
        quantized, x_scales, outliers = bnb.functional.int8_vectorwise_quant(
            x.to(torch.float16).contiguous(), threshold=threshold
        )
        out, _ = torch.ops.bitsandbytes.int8_mixed_scaled_mm(
            x, quantized, rows, x_scales, scales, outliers, bias
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, scales = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.to(ctx.dtype) @ _int8_weight(rows, scales, ctx.dtype)  # (rows, in)
        if ctx.needs_input_grad[3]:
            grad_bias = grad.sum(0, dtype=ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None


def _int8_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' `Linear8bitLt.forward` (the bias in the input's dtype, `bnb.matmul`'s choice
    of path) through `_Int8Op`, on the layer's own tensors where it is now; 2-d inside the
    Function, the reshape back outside it, so that the output takes an in-place residual (see
    `Fp8Linear.forward`)."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    dequantize = layer.training and x.device.type in ("cpu", "xpu")  # as `bnb.matmul` picks
    rows = x.reshape(-1, layer.in_features)
    scales = layer.row_scales.view(torch.float32)
    out = _Int8Op.apply(rows, layer.weight.data, scales, bias, layer.state.threshold, dequantize)
    return out.view(*x.shape[:-1], layer.out_features)


def _int8(linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,  # int8 storage; no fp16 copy kept
        threshold=6.0,  # LLM.int8's outlier threshold: such input columns stay 16-bit
        device="meta",
    )
    # bitsandbytes' own quantization (`Int8Params._quantize`: the rows of the fp16 weight), on
    # `device`; called directly because `Int8Params.to` only quantizes a weight that leaves the
    # CPU, and the layer as `Int8Params._quantize` leaves it, where the weight was
    weight = linear.weight.detach().to(device).to(compute_dtype).contiguous()
    rows, scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    home = linear.weight.device
    rows, scales = rows.to(home), scales.to(home)
    # The rows only as the weight's data, the scales only as a buffer of the layer: the layer's
    # own tensors are all a move of the model (`Module._apply`: Lightning's, `Module.to`) and
    # block swap (`ldm.block_swap`, which points them at placeholders on eviction) replace. The
    # CB / SCB that bitsandbytes hangs on the parameter and on `layer.state` stay None: they
    # would keep the tensors they once pointed at (host copies read on the device after a move,
    # every swapped block's weights held on the device). The scales' int32 bits, so that a dtype
    # cast of the model (Lightning's true precision) leaves them as they are; not persistent:
    # bitsandbytes' own `_save_to_state_dict` writes them (as `SCB`).
    layer.weight = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False)
    layer.register_buffer("row_scales", scales.view(torch.int32), persistent=False)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    _bind(
        layer,
        forward=_int8_forward,
        _save_to_state_dict=_int8_save,
        _load_from_state_dict=_int8_load,
    )
    return layer


@contextlib.contextmanager
def _scales_lent_to_bitsandbytes(layer: nn.Module):
    """The stored scales as the parameter's `SCB` for as long as bitsandbytes' own state-dict
    code runs (its save writes `SCB` from there, its load copies a state dict's `SCB` into it,
    so into the stored scales - the host copy while block swap holds the layer); None again
    after, so that no reference outlives the call."""
    layer.weight.SCB = int8_scales(layer)
    try:
        yield
    finally:
        layer.weight.SCB = None


def _int8_save(layer: nn.Module, *args) -> None:
    import bitsandbytes as bnb

    with _scales_lent_to_bitsandbytes(layer):
        bnb.nn.Linear8bitLt._save_to_state_dict(layer, *args)


def _int8_load(layer: nn.Module, *args) -> None:
    import bitsandbytes as bnb

    with _scales_lent_to_bitsandbytes(layer):
        bnb.nn.Linear8bitLt._load_from_state_dict(layer, *args)


class _Nf4Op(torch.autograd.Function):
    """y = x W^T + b with W dequantized from the nf4 bits, in `dtype` (the layer's compute
    dtype): bitsandbytes' own forward on the CPU, to the bit, and on CUDA where its `gemm_4bit`
    op takes the same dequantize + linear (many rows: a training step's tokens); for few rows
    it picks a fused kernel there, which rounds differently. Used instead of bitsandbytes'
    MatMul4Bit, which keeps its weight on the autograd context (`ctx.tensors`) rather than in
    the saved tensors: activation checkpointing cannot drop it then, so every swapped block's
    nf4 weight stayed on the device from the forward to the backward (`ldm.block_swap`). Here
    the bits are saved tensors, and the backward dequantizes them again, as fp8's `_Fp8Op`
    does."""

    @staticmethod
    def forward(ctx, x, bits, quant_state, bias, dtype):
        import bitsandbytes as bnb

        ctx.save_for_backward(bits)
        ctx.quant_state = quant_state
        weight = bnb.functional.dequantize_4bit(bits, quant_state).to(dtype)
        return F.linear(x, weight, bias)  # autocast, when on, applies (as in bitsandbytes' own)

    @staticmethod
    def backward(ctx, grad):
        import bitsandbytes as bnb

        (bits,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = bnb.functional.dequantize_4bit(bits, ctx.quant_state)
            grad_x = grad @ weight.to(grad.dtype)  # (rows, out) @ (out, in), as bitsandbytes
        if ctx.needs_input_grad[3]:
            grad_bias = grad.sum(0)
        return grad_x, None, None, grad_bias, None


def _nf4_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' `Linear4bit.forward` (the input in the compute dtype, the output back in
    the input's) through `_Nf4Op`; 2-d inside the Function, the reshape back outside it, so
    that the output takes an in-place residual (see `Fp8Linear.forward`)."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    fix_4bit_weight_quant_state_from_module(layer)
    dtype = layer.compute_dtype or x.dtype
    bias = None if layer.bias is None else layer.bias.to(dtype)
    rows = x.to(dtype).reshape(-1, layer.in_features)
    out = _Nf4Op.apply(rows, layer.weight, layer.weight.quant_state, bias, dtype)
    return out.view(*x.shape[:-1], layer.out_features).to(x.dtype)


def _nf4(linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=True,  # QLoRA's double quantization of the absmax values
        quant_type="nf4",
        device="meta",
    )
    # bitsandbytes' own quantization (`Params4bit._quantize`), on `device`; the bits and their
    # quant state then where the weight was (`QuantState.to` moves it in place). The CPU-only
    # repacking (`packing_format_for_cpu`) happens only in `Linear4bit.forward`, replaced here
    weight = linear.weight.detach().to(device).to(compute_dtype).contiguous()
    bits, state = bnb.functional.quantize_4bit(
        weight, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4"
    )
    home = linear.weight.device
    state.to(home)
    layer.weight = bnb.nn.Params4bit(
        bits.to(home),
        requires_grad=False,
        quant_state=state,
        blocksize=NF4_BLOCK,
        compress_statistics=True,
        quant_type="nf4",
        bnb_quantized=True,
    )
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    _bind(layer, forward=_nf4_forward, _load_from_state_dict=_nf4_load)
    return layer


def nf4_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of an nf4 layer's quant state, which bitsandbytes keeps outside the layer's
    parameters and buffers: the block absmax and the NF4 levels, and with double quantization
    the second level's absmax and map and the offset."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return tensors


def _nf4_layout(state) -> tuple:
    return tuple(state.shape), state.blocksize, state.quant_type, state.dtype, state.nested


def _nf4_load(
    layer: nn.Module, state: dict, prefix: str, metadata, strict, missing, unexpected, errors
) -> None:
    """An nf4 layer's state dict (bitsandbytes' `Linear4bit` save: the bits as `weight`, the
    quant state's parts as `weight.absmax`, `weight.quant_map`, ...) into this one, which
    bitsandbytes' own load cannot do (it takes the bits and reports the rest as unexpected, so a
    strict load - Lightning's resume onto the run's nf4 base - failed). The parts are copied
    into the layer's own quant state, in place; the bits load as any weight (block swap: into
    the host copy)."""
    import bitsandbytes as bnb

    start = prefix + "weight."
    parts = {k[len(prefix) :]: state.pop(k) for k in [k for k in state if k.startswith(start)]}
    if parts:
        own = layer.weight.quant_state
        found = bnb.functional.QuantState.from_dict(parts, device=own.absmax.device)
        if _nf4_layout(found) != _nf4_layout(own):
            errors.append(
                f"{prefix}weight: an nf4 state of {_nf4_layout(found)} (shape, block, type, "
                f"dtype, nested) for a layer of {_nf4_layout(own)}"
            )
        else:
            with torch.no_grad():
                for mine, theirs in zip(nf4_state_tensors(own), nf4_state_tensors(found)):
                    mine.copy_(theirs)
    bnb.nn.Linear4bit._load_from_state_dict(
        layer, state, prefix, metadata, strict, missing, unexpected, errors
    )


def quantized_layer(
    module: nn.Module, kind: str, compute_dtype: torch.dtype, device: torch.device | None = None
) -> nn.Module | None:
    """The quantized replacement of a frozen layer, or None when `kind` leaves it as it is.
    Quantized on `device` (None: where its weight is) and stored where its weight is: only this
    layer's weight is copied to `device`, and the quantized tensors come back. On the device
    the copy, its compute-dtype cast and the quantized form are all that is held."""
    device = module.weight.device if device is None else torch.device(device)
    if type(module) is nn.Linear:
        if kind == "fp8":
            return Fp8Linear(module, device)
        if kind == "int8":
            return _int8(module, compute_dtype, device)
        if kind == "nf4":
            return _nf4(module, compute_dtype, device)
    if type(module) is nn.Conv2d and kind == "fp8" and module.padding_mode == "zeros":
        # (bitsandbytes has no convolutions: int8 / nf4 leave them as they are)
        return Fp8Conv2d(module, device)
    return None


def quantize_frozen(
    module: nn.Module, kind: str, compute_dtype: torch.dtype, device: torch.device | None = None
) -> int:
    """Replace every frozen Linear (fp8: also Conv2d) of `module` - the base layer of a peft
    LoRA layer or a layer without adapters - by its `kind` quantized form. Trainable layers and
    the adapters stay as they are. Returns the number of layers replaced.

    One layer at a time on `device` (None: where each layer is), each stored back where its
    weights were: a LoRA run quantizes its base at setup, while the model is still on the CPU,
    and bitsandbytes' / torch's kernels on an accelerator take seconds where the CPU takes
    minutes (nf4, int8). The device's peak meanwhile: one layer, unquantized, and its
    quantized form - never the whole base."""
    if kind in ("none", None):
        return 0
    targets = [
        (name, child)
        for name, child in module.named_modules()
        if type(child) in (nn.Linear, nn.Conv2d)
        and not any(p.requires_grad for p in child.parameters())
    ]
    count = 0
    for name, child in targets:
        replacement = quantized_layer(child, kind, compute_dtype, device)
        if replacement is None:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, replacement)
        count += 1
    return count


def is_quantized(module: nn.Module) -> bool:
    return any(_kind_of(m) is not None for m in module.modules())


def _kind_of(layer: nn.Module) -> str | None:
    if isinstance(layer, Fp8Storage):
        return "fp8"
    name = type(layer).__name__
    return {"Linear8bitLt": "int8", "Linear4bit": "nf4"}.get(name)


def quantized_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The quantized layers of `module` by name."""
    return {name: m for name, m in module.named_modules() if _kind_of(m) is not None}


@torch.no_grad()
def dequantize(layer: nn.Module) -> torch.Tensor:
    """A quantized layer's weight as a plain tensor in the dtype it was quantized from (its
    compute dtype for bitsandbytes): what a checkpoint holds, so that files do not depend on
    the base's quantization."""
    kind = _kind_of(layer)
    if kind == "fp8":
        return layer.dequantized(layer.stored_dtype)
    import bitsandbytes as bnb

    weight = layer.weight
    if kind == "nf4":
        state = weight.quant_state  # not swapped: it stays where the layer is
        bits = stored(layer, "weight").data.to(state.absmax.device)
        return bnb.functional.dequantize_4bit(bits, state).to(layer.compute_dtype)
    # int8: the weight the forward and backward compute with, to the bit (`_int8_weight`)
    weight, scales = stored(layer, "weight"), int8_scales(layer)  # block swap: the host copies
    return _int8_weight(weight.data, scales.float(), torch.float32)


def int8_scales(layer: nn.Module) -> torch.Tensor | None:
    """The row scales (SCB, fp32) of an int8 layer made by `quantized_layer` as stored (its
    `row_scales` buffer, or the buffer's host copy while block swap holds the layer: `stored`);
    of another Linear8bitLt, wherever bitsandbytes keeps them."""
    if "row_scales" in layer._buffers:
        return stored(layer, "row_scales").view(torch.float32)
    scales = getattr(layer.weight, "SCB", None)
    if scales is None:
        scales = getattr(getattr(layer, "state", None), "SCB", None)
    return scales


def unsupported(kind: str, device: torch.device) -> str | None:
    """Why `kind` cannot run on `device` with what is installed (None: it can), found by
    quantizing and running one small layer there - the installed bitsandbytes' own answer."""
    if kind in ("none", "auto"):
        return None
    if kind in ("int8", "nf4"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return f"{kind} needs bitsandbytes (pip install bitsandbytes), or use fp8"
    try:
        # the path of a run: a layer on the CPU quantized on `device`, then moved there
        layer = nn.Linear(64, 64).requires_grad_(False)
        dtype = torch.float32
        quantized = quantized_layer(layer, kind, dtype, device).to(device)
        x = torch.randn(2, 64, device=device, requires_grad=True)
        quantized(x).sum().backward()
    except Exception as err:  # whatever the backend raises: its first line names it
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"{kind} does not run on {device.type} here ({first}); use fp8 or none"
    return None
