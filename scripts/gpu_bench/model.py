"""The model rows of scripts/benchmark_gpu.py: one SD 1.x UNet training step, ours against
diffusers' UNet2DConditionModel holding the same weights, channels_last, cuDNN attention, and
torch.compile; and a DiT LoRA step under block swap."""

import copy
import time

import torch

from gpu_bench.measure import (
    attempt,
    card_peak,
    environment,
    median_rate,
    mfu,
    peak_gib,
    reset_peak,
    synchronize,
)


# --- model rows ---------------------------------------------------------------------------------
def unet_inputs(s: dict, device, channels_last=False, batch=None):
    batch = batch or s["batch"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, s["latent"], s["latent"], generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    context = torch.randn(batch, 77, s["unet"]["context_dim"], generator=g)
    target = torch.randn(x.shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return [v.to(device) for v in (x, t, context, target)]


def train_step(model, optimizer, batch, dtype) -> None:
    from bench_common import forward

    x, t, context, target = batch
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = torch.nn.functional.mse_loss(forward(model, x, t, context).float(), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flop_per_image(model, s, device) -> int:
    """Forward + backward FLOPs of one image (FlopCounterMode; linear in the batch)."""
    from bench_common import step_flops

    flops = step_flops(model.to(device), unet_inputs(s, device, batch=1))
    model.cpu()
    return flops


def model_row(model, s, device, dtype, flop_per_image, peak, channels_last=False, kernels=None):
    """Time one training-step variant of `model` (moved to the device here, freed after)."""
    from ldm.attention import preferring
    from ldm.optim import build_optimizer

    reset_peak(device)
    model = model.to(device).train()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model.parameters(), lr=1e-5)  # fused AdamW, both sides
    batch = unet_inputs(s, device, channels_last)

    def step():
        if kernels is None:
            return train_step(model, optimizer, batch, dtype)
        with preferring(kernels):  # in their order: [cudnn, flash] runs cuDNN where it can
            return train_step(model, optimizer, batch, dtype)

    started = time.perf_counter()
    step()  # the first step builds the optimizer state (and compiles, under torch.compile)
    synchronize(device)
    first = time.perf_counter() - started
    rate = median_rate(step, device, s["batch"], s["steps"], s["warmup"])
    row = {
        "img_s": rate,
        "tflop_per_img": flop_per_image / 1e12 if flop_per_image else None,
        "mfu": mfu(flop_per_image, rate, peak),
        "peak_gib": peak_gib(device),
        "first_step_s": first,
    }
    return row  # the model, its optimizer and batch are freed with this frame


def build_ours(s):
    from ldm.util import instantiate_from_config

    torch.manual_seed(0)
    return instantiate_from_config({"target": "ldm.unet.UNetModel", "params": s["unet"]})


def as_diffusers(ours, s):
    """diffusers' UNet2DConditionModel with ours' weights, through diffusers' own converter."""
    from bench_common import original_config
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        create_unet_diffusers_config_from_ldm,
    )

    from ldm.layout import original

    state = {original.unet_key(k): v for k, v in ours.state_dict().items()}
    config = create_unet_diffusers_config_from_ldm(original_config(s["unet"]), state)
    theirs = UNet2DConditionModel(**config)
    theirs.load_state_dict(convert_ldm_unet_checkpoint(state, config))
    return theirs


def rows_model(args, s, device, emit) -> None:
    from ldm.attention import sdpa_kernels

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = card_peak(environment(device)["card"])
    ours = build_ours(s)  # kept on the CPU; each row moves a copy
    flops = flop_per_image(ours, s, device)

    def variant(**options):
        return lambda: model_row(copy.deepcopy(ours), s, device, dtype, flops, peak, **options)

    attempt(emit, "model: ours", variant())
    attempt(
        emit,
        "model: diffusers",
        lambda: model_row(as_diffusers(ours, s), s, device, dtype, flops, peak),
    )
    attempt(emit, "model: ours + channels_last", variant(channels_last=True))
    # SD 1.x has heads of 40, 80 and 160 channels; cuDNN's kernels stop at 128 (flash takes over
    # there: `attention_kernels: [cudnn, flash]`).
    for kernels in (["cudnn", "flash"], ["flash"]) if device.type == "cuda" else (["math"],):
        label = f"model: ours + {'/'.join(kernels)} attention"
        attempt(emit, label, variant(kernels=sdpa_kernels(kernels)))


def rows_compile(args, s, device, emit, channels_last=False) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = card_peak(environment(device)["card"])
    ours = build_ours(s)
    flops = flop_per_image(ours, s, device)
    # Inductor needs a C++ compiler on the CPU; the tiny CPU row checks the plumbing only.
    options = {} if device.type == "cuda" else {"backend": "eager"}

    def compiled(channels_last):
        model = copy.deepcopy(ours)
        if channels_last:
            model.to(memory_format=torch.channels_last)
        model.compile(**options)
        row = model_row(model, s, device, dtype, flops, peak, channels_last=channels_last)
        return {**row, "note": f"compile + first step {row['first_step_s']:.0f} s"}

    label = "model: ours + torch.compile" + (" + channels_last" if channels_last else "")
    attempt(emit, label, lambda: compiled(channels_last))


def rows_compile_channels_last(args, s, device, emit) -> None:
    rows_compile(args, s, device, emit, channels_last=True)


# --- block swap -----------------------------------------------------------------------------------
# The paths of `ldm.block_swap` that only run on an accelerator (copies from pinned host memory on
# a side stream, the compute stream waiting on their events) and the quantized bases under it, run
# once on the device. One LoRA training step of a DiT (DiT-XL/2 at 256 px: 28 blocks, batch 8,
# bf16 autocast) with every block swapped (two on the device at once) against the same model
# without swap, for a bf16, an fp8, an int8 and an nf4 base: the peak memory and step time of each,
# and how far the swapped step's output and adapter gradients are from the plain one's (0 when the
# copies are complete and ordered and the kernels deterministic). And an int8 base after
# Lightning's move, against the CPU's step (`moved_int8_row`).
DIT_XL = {"input_size": 32, "patch_size": 2, "hidden_size": 1152, "depth": 28, "num_heads": 16}
DIT_TINY = {"input_size": 8, "patch_size": 2, "hidden_size": 64, "depth": 4, "num_heads": 2}


def dit_config(s: dict) -> dict:
    return DIT_TINY if s["latent"] <= 8 else DIT_XL


def lora_dit(s: dict):
    """The DiT with LoRA adapters (r 8) on its attention and MLP layers, the rest frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    from ldm.dit import DiT

    torch.manual_seed(0)
    model = DiT(in_channels=4, **dit_config(s))
    targets = ["qkv", "proj", "fc1", "fc2"]
    config = LoraConfig(r=8, target_modules=targets, init_lora_weights=False)
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def held_base(model, kind: str, dtype: torch.dtype, device):
    """`model`'s blocks' frozen layers in `kind`, its other frozen layers in `dtype`, on the CPU,
    as a LoRA run's setup holds them (ldm.lora.hold_base_for_training): quantized by the call a
    run makes (`quantize_base` with its LightningModule, the backbone at `.model`, and its
    trainer, the device at `strategy.root_device`), on `device`, layer by layer. Returns the
    model and the quantization's seconds (the run's start-up figure)."""
    from types import SimpleNamespace

    from ldm.lora import quantize_base
    from ldm.lora.base import hold_frozen_in

    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device))
    synchronize(device)
    start = time.perf_counter()
    quantize_base(SimpleNamespace(model=model), kind, dtype, trainer)
    synchronize(device)
    seconds = time.perf_counter() - start
    if dtype != torch.float32:
        hold_frozen_in(model, dtype)
    return model, seconds


def vs_the_cpu(model, base, kind: str, dtype: torch.dtype) -> float:
    """The largest difference between the first block's weights quantized on the device
    (`base`) and the same weights quantized on the CPU (dequantized; 0 on a CPU run)."""
    from ldm.block_swap import blocks_of
    from ldm.quantize import dequantize, quantize_frozen, quantized_layers

    if kind == "none":
        return 0.0
    on_cpu = copy.deepcopy(blocks_of(model)[0])
    quantize_frozen(on_cpu, kind, dtype)
    pairs = zip(quantized_layers(blocks_of(base)[0]).values(), quantized_layers(on_cpu).values())
    return max((dequantize(a).float() - dequantize(b).float()).abs().max().item() for a, b in pairs)


def step_inputs(s: dict, device):
    g = torch.Generator().manual_seed(0)
    side, batch = dit_config(s)["input_size"], max(1, s["batch"] // 2)
    x = torch.randn(batch, 4, side, side, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    return x.to(device), t.to(device), {"y": y.to(device)}


def one_step(model, inputs, dtype):
    """Forward and backward; the output and the adapters' gradients, on the CPU."""
    with torch.autocast(inputs[0].device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(*inputs)
    out.float().square().mean().backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.float().cpu(), grads


def timed(model, inputs, dtype, device, repeats: int = 3):
    """(seconds of the median step, peak GiB, the first step's output and gradients)."""
    result = one_step(model, inputs, dtype)  # also the warm-up
    steps_per_s = median_rate(lambda: one_step(model, inputs, dtype), device, 1, repeats, 0)
    return 1 / steps_per_s, peak_gib(device), result


def swap_row(s: dict, model, device, kind: str) -> dict:
    """The swapped step against the plain one; also the start-up of a `kind` base: the seconds
    a run's setup quantizes it in (`quantize_s`), and how far that is from the CPU's result."""
    from ldm.block_swap import blocks_of, swap_blocks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base, quantize_s = held_base(copy.deepcopy(model), kind, dtype, device)
    vs_cpu = vs_the_cpu(model, base, kind, dtype)
    swapped = copy.deepcopy(base)
    reset_peak(device)
    plain = base.to(device)  # as Lightning moves a model: after its setup
    inputs = step_inputs(s, device)
    plain_s, plain_peak, (plain_out, plain_grads) = timed(plain, inputs, dtype, device)
    del plain, base
    reset_peak(device)
    count = len(blocks_of(swapped))
    swap_blocks(swapped, count, device)  # in Lightning's setup hook: before the move
    swapped = swapped.to(device)
    swap_s, swap_peak, (out, grads) = timed(swapped, inputs, dtype, device)
    grad_diff = max((grads[n] - g).abs().max().item() for n, g in plain_grads.items())
    return {
        "s_per_step": swap_s,
        "vs_plain": plain_s / swap_s,
        "peak_gib": swap_peak,
        "plain_peak_gib": plain_peak,
        "blocks_swapped": count,
        "max_out_diff": (out - plain_out).abs().max().item(),
        "max_grad_diff": grad_diff,
        "same_grads": grads.keys() == plain_grads.keys(),
        "quantize_s": quantize_s,  # the base's blocks, on the device, layer by layer
        "quantized_vs_cpu": vs_cpu,
    }


def moved_int8_row(s: dict, model, device) -> dict:
    """An int8 base through a run's path: quantized by `quantize_base` on
    the device, the model moved there as Lightning moves it (`Module.to`: bitsandbytes' own
    CB / SCB, where they were kept, stayed behind: `ldm.quantize._int8`), one step; its output and adapter
    gradients against the same base quantized and stepped on the CPU, one sample each."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cpu = torch.device("cpu")
    x, t, cond = step_inputs(s, cpu)

    def first_sample(device):
        return x[:1].to(device), t[:1].to(device), {k: v[:1].to(device) for k, v in cond.items()}

    on_cpu, _ = held_base(copy.deepcopy(model), "int8", dtype, cpu)
    want_out, want_grads = one_step(on_cpu, first_sample(cpu), dtype)
    del on_cpu
    base, quantize_s = held_base(copy.deepcopy(model), "int8", dtype, device)
    out, grads = one_step(base.to(device), first_sample(device), dtype)  # Lightning's move
    return {
        "max_out_diff": (out - want_out).abs().max().item(),
        "out_absmax": want_out.abs().max().item(),
        "max_grad_diff": max((grads[n] - g).abs().max().item() for n, g in want_grads.items()),
        "grad_absmax": max(g.abs().max().item() for g in want_grads.values()),
        "same_grads": grads.keys() == want_grads.keys(),
        "quantize_s": quantize_s,
    }


def rows_swap(args, s, device, emit) -> None:
    model = lora_dit(s)  # built once (DiT-XL: 675 M weights), on the CPU
    # as a trained base: DiT starts with its modulations and output layer at zero (adaLN-Zero),
    # which makes every output and adapter gradient zero, and any two steps alike
    torch.manual_seed(1)
    for layer in model.zero_init_layers():
        torch.nn.init.normal_(layer.weight, std=0.02)
    for kind in ("none", "fp8", "int8", "nf4"):
        base = "bf16" if kind == "none" and device.type == "cuda" else kind
        label = f"swap: DiT LoRA step, every block swapped, {base} base"
        attempt(emit, label, lambda kind=kind: swap_row(s, model, device, kind))
    label = "int8 base, no swap: LoRA step after Lightning's move"
    attempt(emit, label, lambda: moved_int8_row(s, model, device))
