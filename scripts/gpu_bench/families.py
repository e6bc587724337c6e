"""The family rows of scripts/benchmark_gpu.py (issues 33 and 34): the SD 3.5 Medium MMDiT
training step against diffusers' SD3Transformer2DModel, the memory plan of a Flux.1-dev LoRA
against the device's measured peak (fp8 base; nf4 base with block swap), `main.py` with
`blocks_to_swap: auto` on a card emulated smaller than the model, and the EMA's device-shadow
test (skipped where there is no accelerator)."""

import gc
import json
import re
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from gpu_bench.measure import (
    ROOT,
    attempt,
    median_rate,
    one_line,
    peak_gib,
    python,
    reset_peak,
    synchronize,
    tail,
)
from ldm.mmdit import SD35_MEDIUM_DUAL_ATTENTION_LAYERS


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _train_step(forward, model, optimizer, batch, dtype) -> None:
    """Forward under autocast (none in fp32), flow-matching MSE on the batch's last tensor."""
    x = batch[0]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = forward(model, batch)
    F.mse_loss(out.float(), batch[-1]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --- issue 33 item 9: MMDiT, ours against diffusers ------------------------------------------------
# SD 3.5 Medium (MMDiT-X, 2.5 B): 24 joint blocks, width 1536, 24 heads, QK RMSNorm, attn2 in
# blocks 0..12, a 384^2 position table (ldm.mmdit.sd35_medium); at 1024 px (128^2 latents, 4096
# image tokens) batch 1 and at 512 px batch 4, 154 text tokens (77 CLIP + 77 T5).
SD35_MEDIUM = dict(
    depth=24,
    hidden_size=1536,
    num_heads=24,
    pos_embed_max_size=384,
    qk_norm=True,
    dual_attention_layers=list(SD35_MEDIUM_DUAL_ATTENTION_LAYERS),  # MMDiT-X's, as the preset
)
MMDIT_TINY = dict(
    depth=2,
    hidden_size=64,
    num_heads=2,
    pos_embed_max_size=16,
    qk_norm=True,
    dual_attention_layers=[0],
    context_dim=32,
    pooled_dim=16,
)
MMDIT_SETTINGS = {False: [(1, 128, 154), (4, 64, 154)], True: [(2, 8, 8)]}  # batch, latent, tokens


def _one_setting(module, model, optimizer, network, setting, steps, warmup, dtype, device):
    batch_size, latent, tokens = setting
    batch = module.inputs(device, network, batch_size, latent, tokens)
    reset_peak(device)

    def step():
        _train_step(module.forward, model, optimizer, batch, dtype)

    rate = median_rate(step, device, batch_size, steps, warmup)
    return {"img_s": rate, "peak_gib": peak_gib(device)}


def one_side(module, model, network, settings, steps, warmup, device) -> list[dict]:
    """Per (batch, latent, tokens): img/s and the peak memory of the step (weights, fused AdamW
    state, gradients and activations: the same weights and state on both sides)."""
    from ldm.optim import build_optimizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(device).train()
    optimizer = build_optimizer(model.parameters(), lr=1e-5)
    found = []
    for setting in settings:
        try:  # one setting failing (out of memory) leaves the others their figures
            found.append(
                _one_setting(
                    module, model, optimizer, network, setting, steps, warmup, dtype, device
                )
            )
        except Exception as err:  # noqa: BLE001 - its row says why
            print(f"{setting} (batch, latent, tokens): failed: {one_line(err)}", flush=True)
            found.append({"error": one_line(err)})
        optimizer.zero_grad(set_to_none=True)  # a failed step's gradients
        _free(device)  # its activations (after the except block: its traceback held them)
    return found  # the optimizer state is freed with this frame


def against_diffusers(family, module, network, settings, what, args, s, device, emit):
    """`module` (scripts/benchmark_<family>.py) builds ours and diffusers' model with the same
    weights (diffusers' single-file converter), here on the device (random init of 2 x 2.5 B
    fp32 values takes minutes on a CPU); the outputs are compared in fp32 first; then each side
    alone on the device, fused AdamW, bf16 autocast on a GPU."""
    started = time.perf_counter()
    with torch.device(device):
        ours, theirs = module.build_models(device, network)
    synchronize(device)  # the random init's kernels, queued
    built = time.perf_counter() - started
    _, latent, tokens = settings[0]
    with torch.no_grad():
        batch = module.inputs(device, network, 1, latent, tokens)
        out = module.forward(ours, batch).float()
        gap = (out - module.forward(theirs, batch).float()).abs().max().item()
        scale = out.abs().mean().item()
    del batch, out
    theirs.cpu()
    _free(device)
    steps, warmup = s["steps"] // 2, s["warmup"]
    mine = one_side(module, ours, network, settings, steps, warmup, device)
    del ours  # and its optimizer state, freed with one_side's frame
    _free(device)
    other = one_side(module, theirs, network, settings, steps, warmup, device)
    for (batch_size, latent, _), a, b in zip(settings, mine, other, strict=True):
        px = latent * 8
        both = "error" not in a and "error" not in b
        memory = a["peak_gib"] / b["peak_gib"] if both and a["peak_gib"] and b["peak_gib"] else None
        emit(
            {
                "row": f"{family}: ours, {what}, {px} px batch {batch_size}",
                **a,
                "vs_diffusers": a["img_s"] / b["img_s"] if both else None,
                "memory_vs_diffusers": memory,
                "max_out_diff": gap,
                "mean_abs_out": scale,
                "build_s": built,
            }
        )
        emit({"row": f"{family}: diffusers, {px} px batch {batch_size}", **b})


def rows_mmdit(args, s, device, emit) -> None:
    import benchmark_mmdit

    network = MMDIT_TINY if args.tiny else SD35_MEDIUM
    what = "tiny" if args.tiny else "SD 3.5 Medium (2.5 B, 24 joint blocks)"
    settings = MMDIT_SETTINGS[args.tiny]
    against_diffusers("mmdit", benchmark_mmdit, network, settings, what, args, s, device, emit)


# --- issue 34 item 6: the Flux.1 step, ours against diffusers, at reduced depth --------------------
# Flux.1-dev's width (3072, 24 heads of 128), 4 double + 8 single blocks of its 19 + 38 (2.6 B:
# full depth in fp32 with AdamW state would be 190 GB), 1024 px batch 1, 512 T5 tokens.
FLUX_REDUCED = dict(depth=4, depth_single_blocks=8, hidden_size=3072, num_heads=24)
FLUX_STEP_TINY = dict(depth=1, depth_single_blocks=2, hidden_size=128, num_heads=1)
FLUX_SETTINGS = {False: [(1, 128, 512)], True: [(2, 8, 8)]}


def rows_flux(args, s, device, emit) -> None:
    import benchmark_flux

    network = {**(FLUX_STEP_TINY if args.tiny else FLUX_REDUCED), "guidance_embed": True}
    what = "tiny" if args.tiny else "Flux.1-dev width, 4 double + 8 single blocks (2.6 B)"
    settings = FLUX_SETTINGS[args.tiny]
    against_diffusers("flux", benchmark_flux, network, settings, what, args, s, device, emit)


# --- issue 34 item 4: the plan of a Flux.1-dev LoRA against the measured peak ----------------------
# Flux.1-dev at full size (12 B: 19 double + 38 single blocks, width 3072), LoRA rank 16 on every
# Linear of its blocks, gradient checkpointing per block, 1024 px batch 1, 512 T5 tokens: the
# settings of `python -m lun.memory_quant` (lun.memory_quant.counts_plan). Tiny: width 512 (4
# heads of 128, so the plan's per-head norms hold), 1 + 2 blocks, 64 px, 8 text tokens.
FLUX_FULL = dict(hidden=3072, double=19, single=38, pixels=1024, text_tokens=512, swap=20)
FLUX_TINY = dict(hidden=512, double=1, single=2, pixels=64, text_tokens=8, swap=2)
FLUX_RANK = 16
BETWEEN_STEPS_FREE = ("activations", "gradients", "block swap staging")


def flux_lora(size: dict, kind: str, swap: int, device):
    """Flux with LoRA (fp32 adapters) on a bf16 base whose blocks are quantized as `kind`, the
    first `swap` blocks swapped to host RAM: as a LoRA run's fit start holds it
    (ldm.lora.base.hold_base_for_training). Built on `device` in bf16: 12 B values in fp32 on
    a CPU would take 48 GB and minutes."""
    from peft import LoraConfig, inject_adapter_in_model

    from ldm.block_swap import swap_blocks
    from ldm.flux import Flux, lora_targets
    from ldm.lora.base import quantize_blocks

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Flux(
                depth=size["double"],
                depth_single_blocks=size["single"],
                hidden_size=size["hidden"],
                num_heads=size["hidden"] // 128,
                use_checkpoint=True,
            )
            config = LoraConfig(
                r=FLUX_RANK, lora_alpha=FLUX_RANK, target_modules=lora_targets(model)
            )
            inject_adapter_in_model(config, model)
    finally:
        torch.set_default_dtype(default)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            p.data = p.data.float()
    if kind != "none":
        quantize_blocks(model, kind, torch.bfloat16)
    if swap:
        swap_blocks(model, swap, device)
    return model.train()


def flux_inputs(size: dict, device):
    g = torch.Generator().manual_seed(0)
    side = size["pixels"] // 8
    x = torch.randn(1, 16, side, side, generator=g)
    t = torch.rand(1, generator=g) * 1000
    cond = {
        "crossattn": torch.randn(1, size["text_tokens"], 4096, generator=g).to(device),
        "vector": torch.randn(1, 768, generator=g).to(device),
        "guidance": torch.full((1,), 3.5, device=device),
    }
    return x.to(device), t.to(device), cond, torch.randn(x.shape, generator=g).to(device)


def held_bytes(model, optimizer, device) -> int:
    """Bytes of the tensors the run holds between steps: the allocator's count on an
    accelerator; on the CPU the distinct storages of the model's parameters and buffers,
    bitsandbytes' quantization state, block swap's host copies and the optimizer's state."""
    if device.type != "cpu":
        return torch.cuda.memory_allocated(device)
    from ldm.block_swap import swaps_in
    from lun.memory_quant import quantization_state_tensors

    tensors = [*model.parameters(), *model.buffers(), *quantization_state_tensors(model)]
    tensors += [t for swap in swaps_in(model) for block in swap.host_tensors() for t in block]
    tensors += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def flux_plan_row(size: dict, kind: str, swap: int, device) -> dict:
    """The plan (counts_plan, from parameter counts) against the measured peak of a LoRA step:
    the tensors held between steps plus the peak of one step above them (after a first step
    that made the optimizer state). The plan's 1 GiB CUDA runtime is an assumption the
    allocator does not see: left out of the ratio, and the process's device memory outside the
    allocator is printed beside it."""
    from ldm.optim import build_optimizer
    from lun.memory_parts import DEVICE, HOST, GiB
    from lun.memory_probe import peak_allocated
    from lun.memory_quant import RUNTIME, counts_plan, flux_dev

    counts = flux_dev(size["hidden"], size["double"], size["single"])
    plan = counts_plan(
        counts,
        kind,
        rank=FLUX_RANK,
        pixels=size["pixels"],
        blocks_to_swap=swap,
        text_tokens=size["text_tokens"],
        device=device.type,
    )
    cuda = device.type == "cuda"
    planned = plan.peak(DEVICE if cuda else HOST) - (RUNTIME if cuda else 0)
    parts = {p.name: p.nbytes for p in plan.parts}
    started = time.perf_counter()
    model = flux_lora(size, kind, swap, device)
    synchronize(device)  # the random init's and the quantization's kernels, queued
    built = time.perf_counter() - started
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(adapters, lr=1e-4)
    x, t, cond, target = flux_inputs(size, device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x, t, cond)
        F.mse_loss(out.float(), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state
    held = held_bytes(model, optimizer, device)
    started = time.perf_counter()
    above = peak_allocated(step, device)
    seconds = time.perf_counter() - started
    measured = held + above
    outside = None
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        outside = (total - free - torch.cuda.memory_reserved(device)) / GiB
    row = {
        "plan_gib": planned / GiB,
        "measured_gib": measured / GiB,
        "plan_vs_measured": planned / measured,
        "held_gib": held / GiB,
        # what the plan says is held between steps: all but the step's activations, gradients
        # and block swap's staging (in use while swapped blocks run)
        "plan_held_gib": (planned - sum(parts.get(k, 0) for k in BETWEEN_STEPS_FREE)) / GiB,
        "step_gib": above / GiB,
        "plan_activations_gib": parts["activations"] / GiB,
        "plan_staging_gib": parts.get("block swap staging", 0) / GiB,
        "runtime_assumed_gib": RUNTIME / GiB if cuda else None,
        "outside_allocator_gib": outside,
        "s_per_step": seconds,
        "build_s": built,
    }
    return row  # the model and its optimizer are freed with this frame


def rows_flux_plan(args, s, device, emit) -> None:
    size = FLUX_TINY if args.tiny else FLUX_FULL
    what = "tiny Flux" if args.tiny else "Flux.1-dev full size (12 B)"
    where = f"{size['pixels']} px batch 1, rank {FLUX_RANK}"
    for kind, swap in (("fp8", 0), ("nf4", size["swap"])):
        setting = f"{kind} base" + (f" + {swap} blocks swapped" if swap else "")
        label = f"flux plan: {what} LoRA, {where}, {setting}"
        attempt(emit, label, lambda kind=kind, swap=swap: flux_plan_row(size, kind, swap, device))
        _free(device)


# --- issue 34 item 4: main.py with blocks_to_swap: auto on a card smaller than the model --------
class PeakMemory(pl.Callback):
    """A callback (named in the row's config): the device's peak allocated bytes over the fit,
    written to `out` when it ends (None on a CPU)."""

    def __init__(self, out: str):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        # the fit's own peak: not the memory plan's probe step, nor the base's quantization
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_end(self, trainer, pl_module):
        device = pl_module.device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        Path(self.out).write_text(json.dumps({"peak": peak, "steps": trainer.global_step}))


# main.py in a process whose CUDA allocator refuses anything past `--device-memory` GiB: the card
# the plan is told about is the card the run gets (torch.cuda.set_per_process_memory_fraction).
SMALL_CARD = """
import runpy, sys, torch
gib, argv = float(sys.argv[1]), sys.argv[2:]
if gib and torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
sys.argv = ["main.py", *argv]
runpy.run_path("main.py", run_name="__main__")
"""


def plan_figure(table: str, label: str) -> int:
    """Bytes in the first column (the device's on a GPU, host RAM on a CPU) of the line of
    main.py's plan table that starts with `label`."""
    line = next(line for line in table.splitlines() if line.strip().startswith(label))
    value, unit = re.findall(r"([0-9.]+) (GiB|MiB)", line)[0]
    return int(float(value) * (2**30 if unit == "GiB" else 2**20))


def plan_auto_row(args, s, device, folder: Path) -> dict:
    """`main.py` on the SD 1.x fine-tune config (random weights) as a LoRA, fp8 base,
    `blocks_to_swap: auto`, batch 1, gradient checkpointing: `--plan` on the whole card gives
    the unswapped peak and the frozen UNet's bytes; then `-t` (3 steps) told (`--device-memory`)
    and held to (the allocator's fraction) a card 60 % of the UNet smaller than that peak, so
    the plan must swap most blocks, and neither its probes nor the steps may run out of memory.
    The plan's device peak against the fit's."""
    from gpu_bench.runs import e2e_config, jpegs

    data = jpegs(folder, s["images"], s["image"])
    peak_file = folder / f"peak-{time.time_ns()}.json"
    sizes = {**s, "batch": 1, "e2e_steps": 3}
    overlay = e2e_config(args, sizes, folder, data, folder / "unused.txt", ema=False)
    config = json.loads(overlay.read_text())
    config["model"]["params"]["unet_config"]["params"]["use_checkpoint"] = True
    config["model"]["params"]["lora"] = {
        "rank": 16,
        "base_quantization": "fp8",
        "blocks_to_swap": "auto",
    }
    callbacks = config["lightning"]["callbacks"]
    callbacks["peak_memory"] = {"target": "gpu_bench.families.PeakMemory"}
    callbacks["peak_memory"]["params"] = {"out": str(peak_file)}
    overlay.write_text(json.dumps(config))
    base = ROOT / "configs" / "stable-diffusion" / "v1-finetune.yaml"
    common = ["--base", str(base), str(overlay), "-l", str(folder / "auto-logs")]
    unswapped = card = None
    if device.type == "cuda":  # a CPU has no card to make smaller: the plan swaps nothing there
        whole = python([sys.executable, "main.py", *common, "--plan"], timeout=args.row_timeout)
        unswapped = plan_figure(whole, "= training peak")
        card = (unswapped - 0.6 * plan_figure(whole, "frozen: model")) / 2**30
        common += ["--device-memory", f"{card:.3f}"]
    launch = [sys.executable, "-c", SMALL_CARD, f"{card or 0:.3f}"]
    started = time.perf_counter()
    cmd = [*launch, *common, "-t", "--no-test"]
    trained = python(cmd, timeout=args.row_timeout)
    seconds = time.perf_counter() - started
    chosen = re.findall(r"blocks_to_swap auto: [^\n]*", trained)
    plans = sorted((folder / "auto-logs").glob("*/memory-plan.json"))
    if not chosen or not plans or not peak_file.exists():
        raise RuntimeError(f"main.py left no choice, plan or peak: {tail(trained)}")
    plan = json.loads(plans[-1].read_text())
    place = "device" if device.type == "cuda" else "host"
    planned = plan["peaks"][place]["training"]
    peak = json.loads(peak_file.read_text())
    return {
        "choice": chosen[-1],
        "blocks_to_swap": int(re.findall(r"auto: (\d+)", chosen[-1])[0]),
        "unswapped_plan_gib": unswapped / 2**30 if unswapped else None,
        "card_gib": card,
        "plan_gib": planned / 2**30,
        "measured_gib": peak["peak"] / 2**30 if peak["peak"] else None,
        "plan_vs_measured": planned / peak["peak"] if peak["peak"] else None,
        "steps": peak["steps"],
        "run_s": seconds,
    }


def rows_plan_auto(args, s, device, emit) -> None:
    folder = Path(args.work)
    label = "plan auto: main.py SD 1.x LoRA, fp8, blocks_to_swap auto, card held to --device-memory"
    attempt(emit, label, lambda: plan_auto_row(args, s, device, folder))


# --- the EMA's device shadows: the one test that needs an accelerator --------------------------
def rows_ema_test(args, s, device, emit) -> None:
    test = "tests/lun/callbacks/test_ema_placement.py"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test]
    cmd += ["-k", "accelerator"]
    try:
        out = python(cmd, timeout=args.row_timeout)
    except RuntimeError as err:  # a failed test: pytest exits 1, its summary is in the message
        out = str(err)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    emit(
        {
            "row": "ema test: device shadows (pytest test_ema_placement.py -k accelerator)",
            "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0),
            "skipped": counts.get("skipped", 0),
            "summary": tail(out, 1),
        }
    )
