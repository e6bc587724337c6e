"""The memory plan of a LoRA run on a quantized frozen base, with block swap: what the base's
weights take in each format, the choice of `base_quantization: auto`, and the plan of a model
from its parameter counts alone (Flux.1-dev, before any of its code runs).

Bytes per frozen weight (the formats of `ldm.quantize`):

    none   the compute dtype's size (bf16 2 B, fp32 4 B)
    fp8    1 B + one fp32 scale per output channel
    int8   1 B + one fp32 scale per output row (bitsandbytes' SCB)
    nf4    0.5 B + one uint8 absmax per block of 64 (double quantization) + one fp32 absmax per
           256 of those + the 8-bit map of that second level (256 fp32) + the 16 NF4 levels
           (fp32) + the absmax values' mean, subtracted before their quantization (one fp32:
           bitsandbytes' `QuantState.offset`) per layer

Block swap keeps the swapped blocks in host RAM and `resident` of them on the device at once.
On an accelerator their host copies are pinned, one allocation per tensor, and torch's caching
host allocator rounds each one up to a power of two (`pinned_bytes`): up to twice the bytes.

The launcher's plan (`lun.memory.plan_run`) quantizes the built model before it measures, so its
parts are the real tensors; `quantization_state_part` adds what bitsandbytes keeps outside the
parameters. `auto` tries none, fp8, int8, nf4 in that order (each costs more precision than the
one before) and takes the first whose plan fits the device; `blocks_to_swap: auto` then (or
when none fits unswapped: fp8, int8, then nf4) the fewest swapped blocks whose re-plan fits
(`plan_with_quantization`), in the order of `choose`.
"""

import argparse
import dataclasses
import math
import os
import re
import sys

import torch

from ldm.quantize import nf4_state_tensors
from lun.memory_parts import DEVICE, HOST, GiB, MemoryPlan, MemoryPlanError, Part, _gib

ORDER = ("none", "fp8", "int8", "nf4")  # the cheapest in precision first
NF4_BLOCK, DQ_BLOCK = 64, 256
# What a CUDA process holds besides tensors: its context, cuBLAS / cuDNN workspaces and the
# caching allocator's fragmentation. An assumption (typically 0.5-1 GiB on an H100 / 4090).
RUNTIME = 1 * GiB


def weight_bytes(rows: int, cols: int, kind: str, dtype_size: int = 2) -> int:
    """Bytes of one (rows x cols) frozen weight matrix stored as `kind` (see the table above)."""
    n = rows * cols
    if kind == "none":
        return n * dtype_size
    if kind in ("fp8", "int8"):
        return n + 4 * rows
    if kind == "nf4":
        blocks = math.ceil(n / NF4_BLOCK)
        second_level = 4 * math.ceil(blocks / DQ_BLOCK) + 4 * 256 + 4  # absmax, map, offset
        return math.ceil(n / 2) + blocks + second_level + 4 * 16
    raise ValueError(f"unknown quantization {kind!r}")


def host_tensors(rows: int, cols: int, kind: str, dtype_size: int = 2) -> list[int]:
    """Bytes of each tensor of one frozen weight that block swap holds in host RAM: the layer's
    parameters and buffers (fp8: the bits and the scales). bitsandbytes' nf4 state is an
    attribute of the weight, not a tensor of the module: it stays on the device."""
    n = rows * cols
    if kind == "none":
        return [n * dtype_size]
    if kind in ("fp8", "int8"):
        return [n, 4 * rows]
    if kind == "nf4":
        return [math.ceil(n / 2)]
    raise ValueError(f"unknown quantization {kind!r}")


MiB = 2**20
# What the user may set for torch's allocators, most important first (c10/core/AllocatorConfig.h:
# "The primary environment variable for configuration is `PYTORCH_ALLOC_CONF`. For backward
# compatibility, `PYTORCH_CUDA_ALLOC_CONF` is also supported with lower priority.")
ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
ROUND_SETTING = "pinned_max_round_threshold_mb"  # both in torch 2.13's libc10 and its header


def pinned_limits(environ=os.environ) -> tuple[float, float]:
    """(pinned_max_round_threshold, pinned_max_cached_size) in bytes as torch reads them from
    the first of ALLOC_CONF that is set (`key:value` pairs in MiB, comma-separated); no limit
    (inf) where unset, torch's default."""
    conf = next((environ[name] for name in ALLOC_CONF if environ.get(name)), "")

    def setting(key: str) -> float:
        found = re.search(rf"(?:^|,)\s*{key}\s*:\s*(\d+)", conf)
        return int(found.group(1)) * MiB if found else math.inf

    return setting(ROUND_SETTING), setting("pinned_max_cached_size_mb")


def pinned_bytes(nbytes: int, limits: tuple[float, float] = (math.inf, math.inf)) -> int:
    """Bytes torch's caching host allocator takes for a pinned tensor of `nbytes` (the one
    owner of this rule). torch 2.13, ATen/core/CachingHostAllocator.h, `allocate`:
        roundSize = size <= pinned_max_round_threshold() && size <= pinned_max_cached_size()
                    ? c10::llvm::PowerOf2Ceil(size) : size
    `limits`: those two settings (`pinned_limits`)."""
    if nbytes <= min(limits):
        return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
    return nbytes


def swapped_part(tensors: list[int], device: str, limits=None) -> Part:
    """The host RAM of the swapped blocks' tensors (their sizes in bytes): exact on the CPU
    (nothing pinned), as the pinned allocator takes it on an accelerator."""
    exact = sum(tensors)
    if device == "cpu":
        return Part("frozen: swapped blocks", exact, HOST, "host RAM")
    limits = pinned_limits() if limits is None else limits
    taken = sum(pinned_bytes(t, limits) for t in tensors)
    detail = "pinned host RAM"
    if taken > exact:
        detail += f", {_gib(taken - exact)} of it torch's power-of-two rounding"
        capped = (min(MiB, limits[0]), limits[1])
        if sum(pinned_bytes(t, capped) for t in tensors) < taken:  # the setting would help
            detail += f"; PYTORCH_ALLOC_CONF={ROUND_SETTING}:1 takes tensors over 1 MiB as they are"
    return Part("frozen: swapped blocks", taken, HOST, detail)


STAGING = "block swap staging"


def staging_bytes(swapped: list[int], resident: int | None = None) -> int:
    """Device bytes of block swap's staging: `resident` swapped blocks on the device at once
    (`ldm.block_swap.RESIDENT`: the one computing and the one prefetched), each up to the
    largest of `swapped` (the bytes a swap moves, per swapped block); none swapped, none."""
    from ldm.block_swap import RESIDENT

    return (RESIDENT if resident is None else resident) * max(swapped, default=0)


def block_swap_parts(model: torch.nn.Module, device: str, size_of) -> list[Part]:
    """The parts of the block swaps active in `model` (`ldm.block_swap.swaps_in`): the swapped
    blocks' frozen tensors in host RAM (`swapped_part`) and, on the device, `resident` blocks
    at once, each up to the largest (as `counts_plan`). `size_of(tensor)`: its bytes as the
    run holds it (the plan's dtypes). The device's frozen parts leave these tensors out by
    themselves: a swapped block's module holds empty placeholders."""
    from ldm.block_swap import swaps_in

    swaps = swaps_in(model)
    if not swaps:
        return []
    blocks = [[size_of(t) for t in block] for s in swaps for block in s.host_tensors()]
    resident = max(s.resident for s in swaps)
    staging = staging_bytes([sum(block) for block in blocks], resident)
    on_device = DEVICE if device != "cpu" else HOST
    detail = f"{resident} of the {len(blocks)} swapped blocks on the device at once"
    return [
        swapped_part([t for block in blocks for t in block], device),
        Part(STAGING, staging, on_device, detail),
    ]


def fewest_blocks(peak: int, budget: int, sizes: list[int], now: int = 0) -> int | None:
    """The fewest blocks N (more than `now`, at most all) whose swap brings a device `peak` (with
    `now` blocks swapped) within `budget`: the device loses their frozen bytes (`sizes`, per
    block in the order they run) and holds `RESIDENT` of the largest swapped at once
    (`block_swap_parts`), the rest as it is. None: not even every block. The one owner of this
    rule: the plan's option and `blocks_to_swap: auto` both ask it."""
    for count in range(now + 1, len(sizes) + 1):
        if peak - swap_saves(sizes, now, count) <= budget:
            return count
    return None


def swap_saves(sizes: list[int], now: int, count: int) -> int:
    """Device bytes that swapping `count` blocks instead of `now` saves (see `fewest_blocks`)."""

    def device_bytes(n: int) -> int:  # what the blocks and their staging take on the device
        return sum(sizes[n:]) + staging_bytes(sizes[:n])

    return device_bytes(now) - device_bytes(count)


def swap_option(plan: MemoryPlan, model: torch.nn.Module, size_of) -> list[dict]:
    """`model.params.lora.blocks_to_swap: N` for a LoRA whose device peak is over its budget,
    N the fewest blocks (beyond those swapped now) whose swap makes it fit (`fewest_blocks`),
    kept in the option as "blocks_to_swap" (None where no N fits: the option says so with what
    swapping every block would save). `size_of` as in `block_swap_parts`; `model` unswapped."""
    from ldm.block_swap import blocks_of, frozen_tensors

    settings = getattr(model, "lora_settings", None)
    budget = plan.budget(DEVICE)
    if (
        getattr(settings, "blocks_to_swap", None) is None
        or plan.device == "cpu"  # host RAM either way: nothing to gain
        or budget is None
        or plan.peak(DEVICE) <= budget
    ):
        return []
    try:
        blocks = blocks_of(model.model)
    except ValueError:  # a backbone that does not name its blocks cannot swap them
        return []
    sizes = [sum(size_of(t) for t in frozen_tensors(b)) for b in blocks]
    now = settings.swapped_blocks
    count = fewest_blocks(plan.peak(DEVICE), budget, sizes, now)
    if count is not None:
        how = f"model.params.lora.blocks_to_swap: {count} (of {len(blocks)} blocks)"
        saves = swap_saves(sizes, now, count)
    else:
        how = f"model.params.lora.blocks_to_swap: {len(blocks)} (every block) is not enough alone"
        saves = max(swap_saves(sizes, now, len(blocks)), 0)
    return [{"name": "block swap", "how": how, "saves": {DEVICE: saves}, "blocks_to_swap": count}]


def quantization_state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps outside parameters and buffers: nf4's quantization state
    (absmax, the second level, the maps). (int8's row scales are a buffer of their layer,
    `ldm.quantize`, counted with the frozen parts.)"""
    tensors, seen = [], set()
    for layer in module.modules():
        state = getattr(getattr(layer, "weight", None), "quant_state", None)
        # once per state: a peft LoRA layer's `weight` is its base layer's, the same state
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            tensors += nf4_state_tensors(state)
    return tensors


def quantization_state_bytes(module: torch.nn.Module) -> int:
    """Bytes of `quantization_state_tensors`."""
    return sum(t.numel() * t.element_size() for t in quantization_state_tensors(module))


def quantization_state_part(model: torch.nn.Module) -> list[Part]:
    """The plan's part for the state above (none: no part)."""
    nbytes = quantization_state_bytes(model)
    if not nbytes:
        return []
    return [Part("frozen: quantization state", nbytes, DEVICE, "bitsandbytes scales and absmax")]


def _block_bytes(model, kind: str, size: int) -> list[tuple[int, int]]:
    """Per block of the backbone, (bytes on the device, bytes a swap moves to host RAM) with its
    frozen Linear weights stored as `kind` (fp8: also the Conv2d ones; `weight_bytes`,
    `host_tensors`; what `ldm.lora.quantize_blocks` quantizes), `size` bytes per unquantized value; its other frozen
    tensors (biases, norms) as they are. An estimate for choosing a format before quantizing."""
    from torch import nn

    from ldm.block_swap import blocks_of, frozen_tensors

    quantized = (nn.Linear, nn.Conv2d) if kind == "fp8" else (nn.Linear,)  # as ldm.quantize
    found = []
    for block in blocks_of(model.model):
        layers = [
            m
            for m in block.modules()
            if type(m) in (nn.Linear, nn.Conv2d) and not m.weight.requires_grad
        ]
        ids = {id(m.weight) for m in layers}
        other = sum(t.numel() * t.element_size() for t in frozen_tensors(block) if id(t) not in ids)
        shapes = [
            (m.weight.shape[0], m.weight[0].numel(), kind if type(m) in quantized else "none")
            for m in layers
        ]
        total = sum(weight_bytes(r, c, k, size) for r, c, k in shapes) + other
        moved = sum(sum(host_tensors(r, c, k, size)) for r, c, k in shapes) + other
        found.append((total, moved))
    return found


# The keys `auto` may stand for, and what to name instead where no plan resolves them
AUTO_KEYS = {
    "base_quantization": f"the format ({', '.join(ORDER)})",
    "blocks_to_swap": "the number of blocks (main.py --plan on one process prints the one it picks)",
}
SWAPPABLE = ("fp8", "int8", "nf4")  # the formats tried with block swap, in ORDER's order
REPLANS = 8  # re-plans of `blocks_to_swap: auto` (a bisection over up to 2^7 blocks)


def plan_with_quantization(model, trainer, make_plan) -> MemoryPlan:
    """`make_plan()` (lun.memory.memory_plan) after quantizing `model`'s base as its LoRA
    settings say, its blocks swapped as they say. `auto` is resolved here, in `choose`'s order:
    each format of ORDER unswapped (`base_quantization: auto`: the first that fits), then (with
    `blocks_to_swap: auto`) fp8, int8 and nf4 with the fewest swapped blocks that fit; the settings
    take the choice. A setting that the installed bitsandbytes or the device cannot run is
    refused in one line, and so is `auto` on several processes (only rank 0 plans)."""
    settings = getattr(model, "lora_settings", None)
    if settings is None:
        return make_plan()
    for key, what in AUTO_KEYS.items():
        if getattr(settings, key) == "auto" and trainer.world_size > 1:
            raise MemoryPlanError(
                f"model.params.lora.{key}: auto is chosen by rank 0's plan; name {what} for a "
                f"run on {trainer.world_size} processes"
            )
    swap_auto = settings.blocks_to_swap == "auto"
    if swap_auto:  # planned unswapped first
        model.lora_settings = dataclasses.replace(settings, blocks_to_swap=0)
    plan = _plan_format(model, trainer, make_plan, swap_auto)
    return _plan_swap(model, plan, make_plan) if swap_auto else plan


def _plan_format(model, trainer, make_plan, swap_auto: bool) -> MemoryPlan:
    """The plan with the base quantized as `base_quantization` says, `auto` resolved."""
    from ldm import lora, quantize

    settings = model.lora_settings
    if settings.base_quantization == "none":
        return make_plan()
    dtype = lora.training_dtype(trainer.precision, settings.base_dtype) or torch.float32
    kind = settings.base_quantization
    if kind != "auto":
        lora.quantize_base(model, kind, dtype, trainer)  # refuses an unsupported one
        return make_plan()
    plan = make_plan()
    place = DEVICE if plan.device != "cpu" else HOST
    budget = plan.budget(place)
    size = dtype.itemsize
    skip = settings.swapped_blocks  # those blocks are in host RAM: no device bytes to save
    now = sum(total for total, _ in _block_bytes(model, "none", size)[skip:])
    device = trainer.strategy.root_device
    why_not: dict[str, str | None] = {}  # asked only of the formats tried

    def runs(kind: str) -> bool:
        if kind not in why_not:
            why_not[kind] = quantize.unsupported(kind, device)
        return why_not[kind] is None

    chosen, need, swapping = "none", plan.peak(place), False
    for kind in ORDER:
        if not runs(kind):
            continue
        need = plan.peak(place) - now + sum(t for t, _ in _block_bytes(model, kind, size)[skip:])
        chosen = kind
        if budget is None or need <= budget:
            break
    else:  # none fits unswapped: fp8, int8, then nf4, with the fewest blocks swapped that fit
        for kind in (k for k in SWAPPABLE if swap_auto and place == DEVICE and runs(k)):
            blocks = _block_bytes(model, kind, size)
            unswapped = plan.peak(place) - now + sum(total for total, _ in blocks)
            if fewest_blocks(unswapped, budget, [moved for _, moved in blocks]) is not None:
                chosen, need, swapping = kind, unswapped, True
                break
    model.lora_settings = dataclasses.replace(settings, base_quantization=chosen)
    after = " unswapped; block swap follows" if swapping else ""
    print(f"base_quantization auto: {chosen} base, {_gib(need)} of {_gib(budget)}{after}")
    if chosen == "none":
        return plan
    lora.quantize_base(model, chosen, dtype, trainer)
    return make_plan()


def _plan_swap(model, plan: MemoryPlan, make_plan) -> MemoryPlan:
    """`blocks_to_swap: auto` on `plan` (the model unswapped): 0 where it fits, else the fewest
    blocks N whose re-plan (its probe measuring the swapped model) fits. The plan's own option
    (`swap_option`) is the first guess, every block where it finds none; a guess over budget
    is followed by its re-plan's option, a guess that fits by the middle of the numbers not
    tried below it - the option's estimate can be off either way: it keeps the step's
    activations as they are, which swapped blocks (checkpointed) shrink, and a plan whose
    device could not hold its probe step knows only a lower bound of them (`lun.memory`).
    At most `REPLANS` re-plans. The settings take the N; where none fits, 0, and the
    unswapped plan is left for `check` to refuse with its options."""
    from ldm.block_swap import blocks_of

    settings = model.lora_settings
    budget = plan.budget(DEVICE)
    try:
        depth = len(blocks_of(model.model))
    except ValueError:
        depth = None
    why = None
    if plan.device == "cpu":
        why = "the run is on the CPU: host RAM either way"
    elif budget is None:
        why = "no device budget known"
    elif depth is None:
        why = "the backbone names no blocks to swap"
    if why:
        print(f"blocks_to_swap auto: 0 ({why})")
        return plan

    def option_of(over: MemoryPlan) -> int:
        found = [o["blocks_to_swap"] for o in over.options if o["name"] == "block swap"]
        return found[0] if found and found[0] is not None else depth

    unswapped, over = plan, 0
    fits = {0: plan} if plan.peak(DEVICE) <= budget else {}  # N -> its plan
    guess = option_of(plan)
    for _ in range(0 if fits else REPLANS):
        model.lora_settings = dataclasses.replace(settings, blocks_to_swap=guess)
        plan = make_plan()
        if plan.peak(DEVICE) <= budget:
            fits[guess] = plan
        else:
            over = max(over, guess)
        fewest = min(fits, default=None)
        if fewest is None and guess < depth:
            guess = max(option_of(plan), over + 1)
        elif fewest is not None and fewest - over > 1:
            guess = (over + fewest) // 2
        else:
            break
    if not fits:
        model.lora_settings = dataclasses.replace(settings, blocks_to_swap=0)
        print(f"blocks_to_swap auto: 0, as swapping all {depth} blocks would not fit either")
        return unswapped
    count = min(fits)
    model.lora_settings = dataclasses.replace(settings, blocks_to_swap=count)
    print(
        f"blocks_to_swap auto: {count} of {depth} blocks, {_gib(fits[count].peak(DEVICE))} of {_gib(budget)}"
    )
    return fits[count]


# --- a plan from parameter counts ------------------------------------------------------------
@dataclasses.dataclass
class BlockCounts:
    """One kind of block: its Linear weights (rows, cols), its other tensors' lengths (biases,
    norms), how many of it, and the activations one of it keeps per token (values, see
    `ModelCounts`)."""

    linears: list[tuple[int, int]]
    other: list[int]
    count: int
    activations_per_token: int


@dataclasses.dataclass
class ModelCounts:
    name: str
    blocks: list[BlockCounts]
    rest_linears: list[tuple[int, int]]  # embedders and the output layer (kept as they are)
    rest_other: int
    hidden: int

    def total(self) -> int:
        values = sum(r * c for r, c in self.rest_linears) + self.rest_other
        for b in self.blocks:
            values += b.count * (sum(r * c for r, c in b.linears) + sum(b.other))
        return values


def flux_dev(h: int = 3072, double: int = 19, single: int = 38) -> ModelCounts:
    """Flux.1-dev's transformer (BFL's flux/model.py, FluxParams of "flux-dev"): hidden 3072,
    24 heads of 128, MLP ratio 4, 19 double-stream and 38 single-stream blocks, 64-channel
    patches (16 latent channels x 2 x 2), T5 4096 wide, CLIP pooled 768, guidance embedding.
    Linear weights by shape (out, in); biases and RMSNorm scales, one vector each, as `other`.
    Other widths and depths: the same architecture reduced (the plan's checks against measured
    memory)."""
    mlp, head = 4 * h, 128
    double_linears = 2 * [(6 * h, h), (3 * h, h), (h, h), (mlp, h), (h, mlp)]  # img and txt
    double_other = 2 * [6 * h, 3 * h, h, mlp, h, head, head]  # the biases, q and k norms
    single_linears = [(3 * h + mlp, h), (h, h + mlp), (3 * h, h)]  # linear1, linear2, modulation
    single_other = [3 * h + mlp, h, 3 * h, head, head]
    # Per token, the values one block's forward makes that its backward reads (q, k, v, the
    # attention output, the MLP's hidden before and after its GELU, the modulated inputs), at
    # twice for their gradients while the block's backward runs: an estimate from the shapes.
    double_act = 2 * (3 * h + h + 2 * mlp + 2 * h)
    single_act = 2 * (3 * h + mlp + h + mlp + (h + mlp) + h)
    mlp_embed = [(h, 256), (h, h)]  # timestep / guidance MLPs
    rest = [(h, 64), (h, 4096), *mlp_embed, *mlp_embed, (h, 768), (h, h), (2 * h, h), (64, h)]
    rest_other = h + h + 3 * (2 * h) + 2 * h + 64
    return ModelCounts(
        "Flux.1-dev" if (h, double, single) == (3072, 19, 38) else "Flux-like",
        [
            BlockCounts(double_linears, double_other, double, double_act),
            BlockCounts(single_linears, single_other, single, single_act),
        ],
        rest,
        rest_other,
        h,
    )


def counts_plan(
    counts: ModelCounts,
    kind: str,
    rank: int = 16,
    pixels: int = 1024,
    batch: int = 1,
    blocks_to_swap: int = 0,
    resident: int = 2,
    text_tokens: int = 512,
    device_budget: int | None = None,
    device: str = "cuda",
) -> MemoryPlan:
    """The plan of LoRA (all the blocks' Linear layers, `rank`) on `counts`' model in bf16
    compute: base as `kind`, AdamW on fp32 adapters, activation checkpointing per block (block
    swap needs it; without it a 12 B transformer's activations alone pass 24 GiB), latents and
    text embeddings cached (no VAE or text encoder on the device). `device`: the run's ("cpu":
    everything in host RAM, nothing pinned)."""
    tokens = batch * ((pixels // 16) ** 2 + text_tokens)  # 8x VAE, 2x2 patches
    on_device = DEVICE if device != "cpu" else HOST
    parts, block_bytes, block_host = [], [], []  # per block: all its bytes, its host tensors
    for b in counts.blocks:
        one = sum(weight_bytes(r, c, kind) for r, c in b.linears) + 2 * sum(b.other)
        host = [t for r, c in b.linears for t in host_tensors(r, c, kind)] + [
            2 * v for v in b.other
        ]
        block_bytes += [one] * b.count
        block_host += [host] * b.count
    swapped = [t for host in block_host[:blocks_to_swap] for t in host]
    # What block swap leaves on the device of a swapped block: nf4's quantization state
    kept = sum(block_bytes[:blocks_to_swap]) - sum(swapped)
    rest = sum(weight_bytes(r, c, "none") for r, c in counts.rest_linears) + 2 * counts.rest_other
    detail = f"{counts.total() / 1e9:.2f} B values, blocks {kind}, embedders bf16"
    base = sum(block_bytes[blocks_to_swap:]) + kept + rest
    parts.append(Part("frozen: base", base, on_device, detail))
    if swapped:
        parts.append(swapped_part(swapped, device))
        staging = staging_bytes([sum(host) for host in block_host[:blocks_to_swap]], resident)
        parts.append(Part(STAGING, staging, on_device, f"{resident} blocks on device"))
    adapters = sum(b.count * sum(rank * (r + c) for r, c in b.linears) for b in counts.blocks)
    trainable = f"{adapters / 1e6:.1f} M, fp32"
    parts.append(Part("weights (trainable)", adapters * 4, on_device, trainable))
    parts.append(Part("gradients", adapters * 4, on_device, "fp32"))
    parts.append(Part("optimizer state", adapters * 8, on_device, "AdamW, 2 fp32 moments"))
    depth = sum(b.count for b in counts.blocks)
    saved = depth * tokens * counts.hidden * 2  # each block's input, bf16
    working = max(b.activations_per_token for b in counts.blocks) * tokens * 2
    parts.append(
        Part("activations", saved + working, on_device, f"checkpointed per block, {tokens} tokens")
    )
    if device != "cpu":
        parts.append(Part("runtime", RUNTIME, DEVICE, "CUDA context, workspaces (assumed)"))
    return MemoryPlan(parts, device, device_budget=device_budget)


def choose(counts: ModelCounts, budget: int, **settings) -> tuple[str, int, MemoryPlan]:
    """The first setting that fits `budget`: each format of ORDER without swap, then each of
    SWAPPABLE (fp8, int8, nf4) with the fewest swapped blocks that fit, up to every block (as
    `_plan_swap` and `ldm.block_swap` allow). MemoryPlanError (each format unswapped and with
    every block swapped) when none does."""
    depth = sum(b.count for b in counts.blocks)
    tried = []
    for kind, swap in [
        *((k, 0) for k in ORDER),
        *((k, n) for k in SWAPPABLE for n in range(1, depth + 1)),
    ]:
        plan = counts_plan(counts, kind, blocks_to_swap=swap, device_budget=budget, **settings)
        if plan.peak(DEVICE) <= budget:
            return kind, swap, plan
        if swap in (0, depth):
            tried.append(
                f"{kind}{f' + {swap} blocks swapped' if swap else ''} {_gib(plan.peak(DEVICE))}"
            )
    raise MemoryPlanError(
        f"memory plan: {counts.name} LoRA does not fit {_gib(budget)}: " + "; ".join(tried)
    )


def describe(counts, kind, swap, plan, rank=16, pixels=1024, batch=1) -> str:
    setting = f"{kind} base" + (f" + {swap} blocks swapped" if swap else "")
    return (
        f"{counts.name} LoRA rank {rank}, {pixels} px, batch {batch}: {setting}, "
        f"{_gib(plan.peak(DEVICE))} of {_gib(plan.device_budget)}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The memory plan of Flux.1-dev LoRA by format.")
    parser.add_argument("--device-memory", type=float, default=24, help="GiB")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pixels", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--base", choices=[*ORDER, "auto"], default="auto")
    parser.add_argument("--blocks-to-swap", type=int, default=0)
    args = parser.parse_args(argv)
    counts, budget = flux_dev(), int(args.device_memory * GiB)
    settings = dict(rank=args.rank, pixels=args.pixels, batch=args.batch)
    try:
        if args.base == "auto":
            kind, swap, plan = choose(counts, budget, **settings)
        else:
            kind, swap = args.base, args.blocks_to_swap
            plan = counts_plan(counts, kind, blocks_to_swap=swap, device_budget=budget, **settings)
            if plan.peak(DEVICE) > budget:
                fits = describe(counts, *choose(counts, budget, **settings), **settings)
                raise MemoryPlanError(
                    f"memory plan: {describe(counts, kind, swap, plan, **settings)} does not "
                    f"fit; this does: {fits}"
                )
    except MemoryPlanError as err:
        print(err, file=sys.stderr)
        return 2
    print(plan.table())
    print(describe(counts, kind, swap, plan, **settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
