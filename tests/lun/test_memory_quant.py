"""The plan of a quantized base (lun.memory_quant): its byte counts per format against the
tensors bitsandbytes / ldm.quantize really allocate, block swap's staging against the profiler's
peak, Flux.1-dev's parameter count against the published one, and the choice it makes."""

import re

import pytest
import torch
from torch import nn

from lun.memory import DEVICE, GiB, MemoryPlanError
from lun.memory_probe import peak_allocated
from lun.memory_quant import choose, counts_plan, flux_dev, quantization_state_bytes

REDUCED = dict(h=256, double=2, single=3)  # Flux's blocks at a reduced width and depth


def build(counts) -> nn.Module:
    """Real modules with the counts' shapes: per block its Linear layers and its other values."""
    backbone = nn.Module()
    blocks = []
    for kind in counts.blocks:
        for _ in range(kind.count):
            block = nn.Module()
            block.layers = nn.ModuleList(nn.Linear(c, r, bias=False) for r, c in kind.linears)
            block.other = nn.ParameterList(torch.zeros(n) for n in kind.other)
            blocks.append(block)
    backbone.blocks = nn.ModuleList(blocks)
    return backbone.requires_grad_(False)


def held_bytes(module: nn.Module) -> int:
    """Every tensor the module holds: parameters, buffers and bitsandbytes' state."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + quantization_state_bytes(module)


def test_flux_dev_has_the_published_parameter_count():
    # diffusers' FluxTransformer2DModel for black-forest-labs/FLUX.1-dev: 11,901,408,320
    assert flux_dev().total() == 11_901_408_320


@pytest.mark.parametrize("kind", ["none", "fp8", "int8", "nf4"])
def test_planned_base_bytes_are_the_allocated_ones_within_10_percent(kind):
    if kind in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    from ldm.quantize import quantize_frozen

    counts = flux_dev(**REDUCED)
    counts.rest_linears, counts.rest_other = [], 0  # only the blocks here
    backbone = build(counts).to(torch.bfloat16)
    quantize_frozen(backbone, kind, torch.bfloat16)
    measured = held_bytes(backbone)
    planned = {p.name: p.nbytes for p in counts_plan(counts, kind).parts}["frozen: base"]
    assert planned == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
@pytest.mark.parametrize("shape", [(64, 64), (96, 320), (40, 1000)])
def test_one_layers_planned_bytes_are_its_tensors_to_the_byte(kind, shape):
    """`weight_bytes` of one quantized Linear against every tensor it holds (nf4: its whole
    quantization state, down to the double quantization's offset): `base_quantization: auto`
    compares these estimates with the budget, and one byte over must not read as a fit."""
    if kind != "fp8":
        pytest.importorskip("bitsandbytes")
    from ldm.quantize import quantized_layer
    from lun.memory_quant import weight_bytes

    rows, cols = shape
    linear = nn.Linear(cols, rows, bias=False).requires_grad_(False)
    layer = quantized_layer(linear, kind, torch.float32)
    assert held_bytes(layer) == weight_bytes(rows, cols, kind)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_block_swap_staging_is_the_profiled_peak(kind):
    from ldm.block_swap import BlockSwap
    from ldm.quantize import quantize_frozen

    if kind == "int8":
        pytest.importorskip("bitsandbytes")
    counts = flux_dev(**REDUCED)
    counts.rest_linears, counts.rest_other = [], 0
    backbone = build(counts).to(torch.bfloat16)
    quantize_frozen(backbone, kind, torch.bfloat16)
    blocks, held = list(backbone.blocks), held_bytes(backbone)
    swap = BlockSwap(blocks, torch.device("cpu"), resident=2)

    def run_through():  # a forward's order, then the backward's
        for i in [*range(len(blocks)), *reversed(range(len(blocks)))]:
            swap.load(i)

    measured = peak_allocated(run_through, torch.device("cpu"))
    plan = counts_plan(counts, kind, blocks_to_swap=len(blocks), device="cpu")
    planned = {p.name: p.nbytes for p in plan.parts}
    assert planned["block swap staging"] == pytest.approx(measured, rel=0.10)
    assert planned["frozen: base"] == 0  # every block in host RAM
    assert planned["frozen: swapped blocks"] == pytest.approx(held, rel=0.10)


def test_flux_dev_goals_fp8_under_22_and_nf4_with_swap_under_16_gib():
    fp8 = counts_plan(flux_dev(), "fp8").peak(DEVICE)
    assert fp8 <= 22 * GiB
    kind, swap, plan = choose(flux_dev(), 16 * GiB)
    assert plan.peak(DEVICE) <= 16 * GiB
    # the full-precision base alone (11.9 B values, bf16) is 22.2 GiB: it cannot fit 24 GiB
    assert choose(flux_dev(), 24 * GiB)[0] == "fp8"
    nf4_swap = counts_plan(flux_dev(), "nf4", blocks_to_swap=20).peak(DEVICE)
    assert nf4_swap < counts_plan(flux_dev(), "nf4").peak(DEVICE) <= 16 * GiB


def test_a_budget_nothing_fits_is_refused_with_the_options():
    with pytest.raises(MemoryPlanError, match=r"Flux.1-dev LoRA does not fit 2.00 GiB: none "):
        choose(flux_dev(), 2 * GiB)


def test_swapping_every_block_is_tried_and_named_in_the_refusal():
    """Block swap may hold every block in host RAM (`ldm.block_swap`, `_plan_swap`): a budget
    only nf4 with all 57 of Flux's blocks swapped fits is that choice, and a budget under it
    names that figure among the options."""
    depth = 19 + 38
    every = counts_plan(flux_dev(), "nf4", blocks_to_swap=depth).peak(DEVICE)
    assert counts_plan(flux_dev(), "nf4", blocks_to_swap=depth - 1).peak(DEVICE) > every
    assert counts_plan(flux_dev(), "fp8", blocks_to_swap=depth).peak(DEVICE) > every
    kind, swap, plan = choose(flux_dev(), every)
    assert (kind, swap, plan.peak(DEVICE)) == ("nf4", depth, every)
    figure = f"nf4 + {depth} blocks swapped {every / GiB:.2f} GiB"
    with pytest.raises(MemoryPlanError, match=re.escape(figure)):
        choose(flux_dev(), every - 1)


def test_main_prints_the_one_line(capsys):
    from lun.memory_quant import main

    assert main(["--device-memory", "24"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("Flux.1-dev LoRA rank 16, 1024 px, batch 1: fp8 base, ")
    assert line.endswith(" of 24.00 GiB")
    assert main(["--device-memory", "2", "--base", "none"]) == 2


def test_auto_takes_the_first_format_whose_plan_fits(tiny_config):
    import lightning.pytorch as pl
    from lora_helpers import build

    from ldm import quantize
    from lun.memory import HOST, memory_plan
    from lun.memory_quant import plan_with_quantization

    def plan_for(budget):
        model = build(tiny_config, "{rank: 2, base_quantization: auto}")
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)

        def make_plan():  # without the process's resident set, which moves between builds
            plan = memory_plan(model, trainer, activations=0, host_budget=budget)
            plan.parts = [p for p in plan.parts if p.name != "process"]
            return plan

        return model, plan_with_quantization(model, trainer, make_plan)

    model, roomy = plan_for(2**40)
    assert model.lora_settings.base_quantization == "none" and not quantize.is_quantized(model)
    # a budget just under the full-precision plan: fp8 is the first that fits, and the plan
    # that comes back is the quantized model's own
    model, tight = plan_for(roomy.peak(HOST) - 2**10)
    assert model.lora_settings.base_quantization == "fp8" and quantize.is_quantized(model)
    assert tight.peak(HOST) <= roomy.peak(HOST) - 2**10


def test_where_fp8_does_not_run_the_swapped_fallback_takes_int8(monkeypatch):
    """`base_quantization: auto` with `blocks_to_swap: auto` on a device where no format fits
    unswapped and fp8 does not run: int8 is the first of SWAPPABLE that does, with the fewest
    blocks swapped that fit (each planned on its own model, as
    tests/lun/test_memory_swap_auto.py finds `choose`'s order)."""
    pytest.importorskip("bitsandbytes")
    from test_memory_swap_auto import FORMATS, SWAPPABLE, peak_with, resolve, tiny_lora

    from ldm import quantize
    from ldm.block_swap import blocks_of

    def unsupported(kind, device):
        return "fp8 does not run here" if kind == "fp8" else None

    monkeypatch.setattr(quantize, "unsupported", unsupported)
    runs = [k for k in FORMATS if k != "fp8"]
    models = {k: tiny_lora(f"{{rank: 2, base_quantization: {k}}}") for k in runs}
    depth = len(blocks_of(models["none"].model))
    peaks = {(k, n): peak_with(models[k], n) for k in runs for n in range(depth + 1)}
    budget = min(peaks[k, 0] for k in runs) - 1  # no format fits unswapped
    order = [(k, 0) for k in runs] + [
        (k, n) for k in SWAPPABLE if k in runs for n in range(1, depth + 1)
    ]
    expected = next((k, n) for k, n in order if peaks[k, n] <= budget)
    assert expected[0] == "int8" and expected[1] > 0  # the case this test is about
    model, plan = resolve("{rank: 2, base_quantization: auto, blocks_to_swap: auto}", budget)
    chosen = (model.lora_settings.base_quantization, model.lora_settings.blocks_to_swap)
    assert chosen == expected
    assert plan.peak(DEVICE) == peaks[expected]
    assert type(next(iter(quantize.quantized_layers(model).values()))).__name__ == "Linear8bitLt"


@pytest.mark.parametrize("kind", ["none", "fp8"])
def test_the_plan_counts_the_blocks_a_real_flux_quantizes(kind):
    """The plan from parameter counts against a real Flux at reduced width and depth (1 double
    + 1 single block, configs/flux/tiny.yaml's depth), its blocks quantized by the trainer's
    own call (`ldm.lora.quantize_blocks`, blocks named by the backbone) and held in bf16: the
    planned bytes of the frozen base within 10 % of every tensor the model holds."""
    from ldm.flux import Flux
    from ldm.lora import quantize_blocks

    flux = Flux(depth=1, depth_single_blocks=1, hidden_size=256, num_heads=2)  # heads of 128
    flux.requires_grad_(False).to(torch.bfloat16)
    quantize_blocks(flux, kind, torch.bfloat16)
    measured = held_bytes(flux)
    planned = counts_plan(flux_dev(h=256, double=1, single=1), kind).parts[0]
    assert planned.name == "frozen: base"
    assert planned.nbytes == pytest.approx(measured, rel=0.10)


# --- pinned host copies as torch's caching host allocator takes them ---------------------------


def power_of_two_at_least(n: int) -> int:
    """c10::llvm::PowerOf2Ceil, by counting up (the rule of ATen/core/CachingHostAllocator.h)."""
    p = 1
    while p < n:
        p *= 2
    return p


def swapped_tensor_bytes(kind: str, counts) -> list[int]:
    """The bytes of every tensor the real BlockSwap holds in host RAM for real modules of
    `counts`' shapes, quantized as `kind`, all their blocks swapped."""
    from ldm.block_swap import BlockSwap
    from ldm.quantize import quantize_frozen

    backbone = build(counts).to(torch.bfloat16)
    quantize_frozen(backbone, kind, torch.bfloat16)
    swap = BlockSwap(list(backbone.blocks), torch.device("cpu"))
    return [host.numel() * host.element_size() for block in swap.host for *_, host in block]


SWAP_SHAPES = dict(h=512, double=1, single=1)  # tensors from 0.25 KiB to 3 MiB


@pytest.mark.parametrize("kind", ["none", "fp8", "int8", "nf4"])
def test_swapped_blocks_count_pinned_rounding_on_an_accelerator_and_exact_bytes_on_the_cpu(
    kind, monkeypatch
):
    if kind in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    counts = flux_dev(**SWAP_SHAPES)
    counts.rest_linears, counts.rest_other = [], 0
    tensors = swapped_tensor_bytes(kind, counts)
    depth = SWAP_SHAPES["double"] + SWAP_SHAPES["single"]

    def swapped_part(device):
        plan = counts_plan(counts, kind, blocks_to_swap=depth, device=device)
        return {p.name: p for p in plan.parts}["frozen: swapped blocks"]

    rounded = sum(power_of_two_at_least(n) for n in tensors)
    assert rounded > sum(tensors)  # some sizes here are not powers of two
    cuda, cpu = swapped_part("cuda"), swapped_part("cpu")
    assert cuda.nbytes == rounded
    assert cpu.nbytes == sum(tensors)
    assert f"{(rounded - sum(tensors)) / 2**20:.1f} MiB of it torch's power-of-two" in cuda.detail
    assert "rounding" not in cpu.detail


def test_the_allocator_settings_turn_the_rounding_off_above_their_size(monkeypatch):
    """pinned_max_round_threshold_mb / pinned_max_cached_size_mb (c10/core/AllocatorConfig.h,
    MiB): sizes above either are taken as they are; PYTORCH_ALLOC_CONF over the older
    PYTORCH_CUDA_ALLOC_CONF."""
    from lun.memory_quant import pinned_limits

    counts = flux_dev(**SWAP_SHAPES)
    counts.rest_linears, counts.rest_other = [], 0
    tensors = swapped_tensor_bytes("none", counts)

    def planned(**env):
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        plan = counts_plan(counts, "none", blocks_to_swap=2, device="cuda")
        return {p.name: p for p in plan.parts}["frozen: swapped blocks"].nbytes

    def expected(limit_mib):
        limit = limit_mib * 2**20
        return sum(power_of_two_at_least(n) if n <= limit else n for n in tensors)

    assert any(n > 2**20 and n != power_of_two_at_least(n) for n in tensors)  # 3 MiB, 1.5 MiB
    assert expected(1) < expected(2) < sum(power_of_two_at_least(n) for n in tensors)
    assert planned(PYTORCH_ALLOC_CONF="pinned_max_round_threshold_mb:1") == expected(1)
    plan = counts_plan(counts, "none", blocks_to_swap=2, device="cuda")
    detail = {p.name: p for p in plan.parts}["frozen: swapped blocks"].detail
    assert "rounding" in detail and "PYTORCH_ALLOC_CONF=" not in detail  # set: not suggested
    assert planned(
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,pinned_max_cached_size_mb:1"
    ) == expected(1)
    both = dict(PYTORCH_ALLOC_CONF="pinned_max_round_threshold_mb:2")
    assert planned(**both, PYTORCH_CUDA_ALLOC_CONF="pinned_max_round_threshold_mb:1") == expected(2)
    assert pinned_limits(
        {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:2"}
    ) == (8 * 2**20, 2 * 2**20)


def test_full_size_flux_nf4_with_swap_counts_the_rounded_pinned_copies(monkeypatch):
    """Flux.1-dev, nf4, 20 blocks swapped (its 19 double blocks and a single one) on a GPU:
    the host part is each swapped tensor rounded up, from BFL's flux/model.py shapes written
    out here (hidden 3072, MLP 12288, heads of 128; nf4 packs two values a byte; biases and
    norm scales bf16)."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    h, mlp, head = 3072, 12288, 128
    stream = {  # one of the double block's two streams: (out, in) weights, then vectors
        "mod.lin": (6 * h, h),
        "attn.qkv": (3 * h, h),
        "attn.proj": (h, h),
        "mlp.0": (mlp, h),
        "mlp.2": (h, mlp),
    }
    stream_vectors = [6 * h, 3 * h, h, mlp, h, head, head]  # the biases, q / k norm scales
    single = {"linear1": (3 * h + mlp, h), "linear2": (h, h + mlp), "modulation.lin": (3 * h, h)}
    single_vectors = [3 * h + mlp, h, 3 * h, head, head]
    double_tensors = 2 * (
        [r * c // 2 for r, c in stream.values()] + [2 * n for n in stream_vectors]
    )
    single_tensors = [r * c // 2 for r, c in single.values()] + [2 * n for n in single_vectors]
    tensors = 19 * double_tensors + single_tensors
    plan = counts_plan(flux_dev(), "nf4", blocks_to_swap=20)
    part = {p.name: p for p in plan.parts}["frozen: swapped blocks"]
    assert part.nbytes == sum(power_of_two_at_least(n) for n in tensors)
    assert part.nbytes > 1.1 * sum(tensors)  # what the plan used to count
    assert "PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:1" in part.detail
    plan_cpu = counts_plan(flux_dev(), "nf4", blocks_to_swap=20, device="cpu")
    assert {p.name: p.nbytes for p in plan_cpu.parts}["frozen: swapped blocks"] == sum(tensors)


def test_nf4_state_under_a_lora_adapter_is_counted_once():
    """peft's LoRA layer answers `.weight` with its base layer's weight: the nf4 state of an
    adapted layer is reachable from two modules and must count once, as the allocator holds it
    (the distinct storages of every Linear4bit's state)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, inject_adapter_in_model

    from ldm.quantize import quantize_frozen

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"]), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    quantize_frozen(model, "nf4", torch.float32)
    storages = {}
    for layer in model.modules():
        if type(layer).__name__ == "Linear4bit":
            state = layer.weight.quant_state
            for t in (state.absmax, state.code, state.state2.absmax, state.state2.code):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            storages[id(state.offset)] = state.offset.numel() * state.offset.element_size()
    assert quantization_state_bytes(model) == sum(storages.values())
