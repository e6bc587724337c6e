"""Where the frozen base is quantized (ldm.quantize.quantize_frozen, ldm.lora.quantize_base): on
the run's device, one layer at a time, each layer kept where its weights were.

On a CPU the layers are bitsandbytes' own (its `Params4bit` / `Int8Params` quantizing on their
move to the CPU, as the code before this did) and fp8 is the formula itself, to the bit. For a
second device this CPU-only machine has torch's lazy tensors (`torch._lazy`, TorchScript backend:
real data, computed on the CPU behind a device of their own): fp8 runs there for real, and
bitsandbytes' quantizers, which have no lazy kernels, run through `on_the_stand_in`: their own CPU
kernels for a weight that arrives on the lazy device, the results sent back there, recording what
was where at each call."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ldm import quantize

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def lazy():
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")


def lazy_tensors_alive() -> int:
    from torch._lazy import metrics

    created = metrics.counter_value("CreateLtcTensor") or 0
    return created - (metrics.counter_value("DestroyLtcTensor") or 0)


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor a layer holds, bitsandbytes' side ones (SCB, the nf4 quant state) too."""
    found = list(module.parameters()) + list(module.buffers())
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        found += [getattr(weight, n, None) for n in ("CB", "SCB")]
        state = getattr(weight, "quant_state", None)
        if state is not None:
            found += [state.absmax, state.code, state.offset, state.state2.absmax]
    return [t for t in found if t is not None]


def off_the_cpu(module: nn.Module) -> int:
    return sum(t.device.type != "cpu" for t in tensors_of(module))


def sent(part, device):
    if isinstance(part, torch.Tensor):
        return part.to(device)
    if part is not None:
        part.to(device)  # bitsandbytes' QuantState moves in place
    return part


@pytest.fixture
def on_the_stand_in(monkeypatch):
    """bitsandbytes' quantizers for a weight on the lazy device: recorded, run, sent back."""
    calls = []

    def wrap(real, model_of):
        def quantizer(weight, *args, **kwargs):
            model = model_of()
            calls.append(
                {
                    "device": weight.device,
                    "lazy_alive": lazy_tensors_alive(),
                    "model_off_cpu": off_the_cpu(model) if model is not None else 0,
                }
            )
            return tuple(sent(p, weight.device) for p in real(weight.cpu(), *args, **kwargs))

        return quantizer

    watched = {}
    for name in ("quantize_4bit", "int8_vectorwise_quant"):
        real = getattr(bnb.functional, name)
        monkeypatch.setattr(bnb.functional, name, wrap(real, lambda: watched.get("model")))
    return calls, watched


def layers(seed=0, count=6):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(count)]).requires_grad_(False)


def bnb_own_on_the_cpu(linear: nn.Linear, kind: str, dtype: torch.dtype) -> dict:
    """What bitsandbytes makes of the weight on the CPU, by its own parameter classes."""
    weight = linear.weight.detach().to(dtype)
    if kind == "int8":
        own = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to("cpu")
        return {"bits": own.data, "scales": own.SCB}
    own = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4")
    own = own.to("cpu")
    return {"bits": own.data, "weight": bnb.functional.dequantize_4bit(own.data, own.quant_state)}


def ours(layer: nn.Module, kind: str) -> dict:
    if kind == "int8":
        return {"bits": layer.weight.data, "scales": quantize.int8_scales(layer)}
    state = layer.weight.quant_state
    return {
        "bits": layer.weight.data,
        "weight": bnb.functional.dequantize_4bit(layer.weight, state),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_on_the_cpu_the_layer_is_bitsandbytes_own(kind, dtype):
    linear = layers(count=1)[0]
    layer = quantize.quantized_layer(linear, kind, dtype, torch.device("cpu"))
    own, got = bnb_own_on_the_cpu(linear, kind, dtype), ours(layer, kind)
    for name in own:
        assert got[name].dtype == own[name].dtype and torch.equal(got[name], own[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_fp8_is_the_per_channel_e4m3_formula(dtype):
    linear = layers(count=1)[0].to(dtype)
    layer = quantize.quantized_layer(linear, "fp8", dtype, torch.device("cpu"))
    w = linear.weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    assert torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.weight, (w / scale).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_bitsandbytes_formats_quantize_on_the_device_one_layer_at_a_time(
    kind, lazy, on_the_stand_in
):
    calls, watched = on_the_stand_in
    model, reference = layers(), layers()
    watched["model"] = model
    assert quantize.quantize_frozen(model, kind, torch.bfloat16, lazy) == 6
    # every weight quantized on the device it was sent to, not where it lived
    assert [c["device"].type for c in calls] == ["lazy"] * 6
    # each layer back on the CPU before the next one goes: nothing of the model on the device,
    # and only the one weight being quantized (and its cast) alive there, not the base
    assert all(c["model_off_cpu"] == 0 for c in calls), calls
    assert max(c["lazy_alive"] for c in calls) <= 3, calls
    assert off_the_cpu(model) == 0
    # the very layers the CPU makes
    watched.clear()
    quantize.quantize_frozen(reference, kind, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(3, 64)
    for got, want in zip(model, reference, strict=True):
        for name, value in ours(want, kind).items():
            assert torch.equal(ours(got, kind)[name], value), name
        assert torch.equal(got(x), want(x))
        x = want(x).float()


def test_fp8_computes_on_the_device_and_stays_on_the_cpu(lazy):
    from torch._lazy import metrics

    model = nn.Sequential(layers(count=2), nn.Conv2d(4, 8, 3)).requires_grad_(False)
    reference = copy.deepcopy(model)
    metrics.reset()
    assert quantize.quantize_frozen(model, "fp8", torch.float32, lazy) == 3
    assert (metrics.counter_value("lazy::div") or 0) >= 3  # the w / scale of each layer
    assert off_the_cpu(model) == 0
    quantize.quantize_frozen(reference, "fp8", torch.float32)
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def tiny_dit():
    from ldm.dit import DiT

    torch.manual_seed(0)
    backbone = DiT(in_channels=4, input_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=2)
    return SimpleNamespace(model=backbone.requires_grad_(False))


def trainer_on(device):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=device))


def test_quantize_base_quantizes_on_the_trainers_device(lazy, monkeypatch):
    """A run's quantization (at setup, the model still on the CPU) on Lightning's root device.
    (The check that the format runs there is asked about that device, and answered yes: fp8's
    autocast query has no lazy device type.)"""
    from torch._lazy import metrics

    from ldm.lora import quantize_base

    asked = []
    monkeypatch.setattr(quantize, "unsupported", lambda kind, device: asked.append(device))
    model, reference = tiny_dit(), tiny_dit()
    metrics.reset()
    count = quantize_base(model, "fp8", torch.float32, trainer_on(lazy))
    assert asked == [lazy]
    assert count > 0 and (metrics.counter_value("lazy::div") or 0) >= count
    assert off_the_cpu(model.model) == 0
    assert quantize_base(reference, "fp8", torch.float32, trainer_on(torch.device("cpu"))) == count
    want = reference.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.model.state_dict().items())


# --- an int8 base after the model's move ----------------------------------------------------------
# Lightning moves the model with `model.to(device)`: `Module._apply`, which on a move between
# devices whose tensors share a type (CPU <-> CUDA) sets each parameter's data (`param.data =`)
# and keeps the parameter object, and replaces each buffer. Whatever bitsandbytes hangs on the
# parameter or on the layer's state is not moved. torch's lazy device cannot stand in here (there
# `Module._apply` makes a new Parameter, which bitsandbytes' Int8Params cannot be), so `moved`
# takes the CUDA path on the CPU: every tensor replaced by a copy, and the old ones overwritten,
# so that a forward that still reads one computes something else.
def moved(module: nn.Module) -> None:
    states = [getattr(m, "state", None) for m in module.modules()]
    left = [t.data for t in tensors_of(module)]
    left += [getattr(s, n) for s in states if s is not None for n in ("CB", "SCB")]
    module._apply(lambda t: t.clone())
    with torch.no_grad():
        for t in left:
            if t is not None:
                t.zero_()


def int8_pair(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).requires_grad_(False)
    assert quantize.quantize_frozen(model, "int8", torch.float32) == 2
    return model, copy.deepcopy(model)


def forward_backward(model, x, g):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * g).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("training", [True, False])  # bitsandbytes' CPU paths differ (dequantize
def test_int8_runs_on_what_the_move_made(training):  # + matmul; its int8 kernels)
    model, never_moved = int8_pair()
    model.train(training), never_moved.train(training)
    torch.manual_seed(1)
    x, g = torch.randn(5, 64) * 3, torch.randn(5, 64)  # x * 3: columns past the 6.0 threshold
    want = forward_backward(never_moved, x, g)
    assert torch.equal(forward_backward(model, x, g)[0], want[0])  # a forward before the move
    moved(model)
    got = forward_backward(model, x, g)
    model.state_dict()  # bitsandbytes' save reads the parameter's SCB: lent for it, taken back
    # bitsandbytes' side references (which a move leaves behind) hold nothing: the forward
    # read the moved layer's own tensors ...
    for layer in (model[0], model[2]):
        assert all(t is None for t in (layer.state.CB, layer.state.SCB, layer.weight.SCB))
    # ... and computes what the layer never moved does, to the bit
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def bnb_own_int8(linear: nn.Linear) -> nn.Module:
    """bitsandbytes' Linear8bitLt quantized by its own move to the CPU (`Int8Params.to`)."""
    own = bnb.nn.Linear8bitLt(64, 96, has_fp16_weights=False, threshold=6.0)
    weight = linear.weight.detach().clone()
    own.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    own.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return own.to("cpu")


def test_int8_state_dict_is_bitsandbytes_own_before_and_after_a_forward_and_a_move():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).requires_grad_(False)
    want = bnb_own_int8(linear).state_dict()
    layer = quantize.quantized_layer(linear, "int8", torch.float32)
    for when in ("made", "after a forward", "after a move"):
        got = layer.state_dict()
        assert list(got) == list(want), when
        assert all(torch.equal(got[k], want[k]) for k in want), when
        layer(torch.randn(3, 64)) if when == "made" else moved(layer)


def test_int8_loads_a_state_dict_after_a_forward_and_a_move():
    """(bitsandbytes' loader writes `SCB` into the parameter's, and refuses without one.)"""
    source, _ = int8_pair(seed=0)
    target, _ = int8_pair(seed=1)
    x = torch.randn(4, 64)
    target(x)
    moved(target)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target(x), source(x))


def test_int8_scales_keep_their_bits_through_a_dtype_cast():
    """Lightning's true precision casts the whole model (`.to(bf16)`): the int8 rows are not
    floating point, and the row scales must stay fp32 to the bit."""
    model, never_moved = int8_pair()
    model.to(torch.bfloat16)
    x = torch.randn(2, 64)
    model(x.bfloat16()), never_moved(x)
    for layer, want in ((model[0], never_moved[0]), (model[2], never_moved[2])):
        scales = layer.state_dict()["SCB"]  # bitsandbytes' own save: what it computes with
        assert scales.dtype == torch.float32
        assert torch.equal(scales, want.state_dict()["SCB"])
        assert torch.equal(quantize.dequantize(layer), quantize.dequantize(want))


# --- an int8 layer's own autograd Function against bitsandbytes' Linear8bitLt --------------------


@pytest.mark.parametrize("training", [True, False])  # bitsandbytes' CPU paths: its MatMul8bitFp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (dequantize + matmul), its
@pytest.mark.parametrize("autocast", [False, True])  # MatMul8bitLt (LLM.int8, outliers apart)
def test_int8_computes_as_bitsandbytes_own_linear8bitlt(training, dtype, autocast):
    """Our int8 layer runs through its own autograd Function (which saves only the int8 rows and
    their scales, for block swap); its output and input gradient are bitwise those of
    bitsandbytes' own Linear8bitLt quantized by its own move, on the same weights."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).requires_grad_(False)
    ours = quantize.quantized_layer(linear, "int8", torch.float32).train(training)
    theirs = bnb_own_int8(linear).train(training)
    x = (torch.randn(3, 5, 64) * 3).to(dtype)  # * 3: columns past the 6.0 outlier threshold
    assert (x.abs() > 6).any(dim=(0, 1)).sum() > 0
    g = torch.randn(3, 5, 96)
    results = []
    for layer in (ours, theirs):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = layer(leaf)
        (out.float() * g).sum().backward()
        results.append((out.detach(), leaf.grad))
    (out, grad), (want, want_grad) = results
    assert out.dtype == want.dtype and torch.equal(out, want)
    assert grad.dtype == want_grad.dtype and torch.equal(grad, want_grad)


@pytest.mark.parametrize("training", [True, False])
def test_int8_saves_its_rows_and_scales_and_nothing_of_its_input(training):
    """What the backward needs (grad_x = grad_y W, W = CB * SCB / 127; the frozen W gets no
    gradient) and nothing more: the rows and the scales, as autograd's saved tensors (which
    activation checkpointing drops and recomputes), none of the input - which is freed once
    the forward no longer holds it, also while the output's graph is alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    layer = quantize.quantized_layer(nn.Linear(64, 96).requires_grad_(False), "int8", torch.float32)
    layer.train(training)
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    leaf = torch.randn(5, 64, requires_grad=True)
    x = leaf * 3  # an activation: only the graph could keep it alive
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    assert sorted(saved, key=str) == sorted(
        [((96, 64), torch.int8), ((96,), torch.float32)], key=str
    )
    input_storage = StorageWeakRef(x.untyped_storage())
    del x
    assert input_storage.expired()
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
