"""The model rows of scripts/benchmark_gpu.py: one SD 1.x UNet training step, ours against
diffusers' UNet2DConditionModel holding the same weights, channels_last, cuDNN attention, and
torch.compile."""

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
    from torch.nn.attention import sdpa_kernel

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
        with sdpa_kernel(kernels):
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
