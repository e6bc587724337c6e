"""The block-swap rows of scripts/benchmark_gpu.py: the paths of `ldm.block_swap` that only run
on an accelerator (copies from pinned host memory on a side stream, the compute stream waiting
on their events) and the quantized bases under it, run once on the device.

One LoRA training step of a DiT (DiT-XL/2 at 256 px: 28 blocks, batch 8, bf16 autocast) with
every block swapped (two on the device at once) against the same model without swap, for a
bf16, an fp8 and an nf4 base: the peak memory and step time of each, and how far the swapped
step's output and adapter gradients are from the plain one's (0 when the copies are complete
and ordered; the same kernels run on the same data)."""

import copy
import time

import torch

from gpu_bench.measure import attempt, peak_gib, reset_peak, synchronize

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
    """`model`'s blocks' frozen layers in `kind`, its other frozen layers in `dtype`, as a LoRA
    run's setup holds them (ldm.lora.hold_base_for_training), back on the CPU. Quantized on
    `device`: bitsandbytes' nf4 on the CPU takes minutes for DiT-XL's 600 M weights."""
    from ldm.lora import quantize_blocks
    from ldm.lora.base import hold_frozen_in

    model.to(device)
    if kind != "none":
        quantize_blocks(model, kind, dtype)
    if dtype != torch.float32:
        hold_frozen_in(model, dtype)
    return model.cpu()


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
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        one_step(model, inputs, dtype)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return sorted(seconds)[len(seconds) // 2], peak_gib(device), result


def swap_row(s: dict, model, device, kind: str) -> dict:
    from ldm.block_swap import blocks_of, swap_blocks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = held_base(copy.deepcopy(model), kind, dtype, device)
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
    }


def rows_swap(args, s, device, emit) -> None:
    model = lora_dit(s)  # built once (DiT-XL: 675 M weights), on the CPU
    for kind in ("none", "fp8", "nf4"):
        base = "bf16" if kind == "none" and device.type == "cuda" else kind
        label = f"swap: DiT LoRA step, every block swapped, {base} base"
        attempt(emit, label, lambda kind=kind: swap_row(s, model, device, kind))
