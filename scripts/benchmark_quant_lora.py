"""scripts/benchmark.py's quant_lora section: a LoRA training step on a quantized frozen base,
ours against diffusers + peft + bitsandbytes.

The Flux.1-dev structure of the flux section (scripts/benchmark_flux.py: width 768, 2 double +
4 single blocks, batch 1 of 32x32x16 latents, 64 T5 tokens), the same weights on both sides. The
frozen Linear layers of the blocks are stored as

- int8: LLM.int8 (bitsandbytes `Linear8bitLt`, outlier threshold 6.0),
- nf4: QLoRA's 4-bit NormalFloat with double quantization (bitsandbytes `Linear4bit`),
- fp8: float8_e4m3fn storage upcast to fp32 in the forward. Ours keeps a scale per output
  channel (`ldm.quantize.Fp8Linear`); diffusers' peer is its layerwise casting
  (`apply_layerwise_casting`, a plain cast, as `enable_layerwise_casting` does),

ours as a LoRA run does it (`ldm.lora.quantize_blocks`, after the adapters: the peft layers'
base layers are replaced), diffusers' as `FluxTransformer2DModel.from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))` does it: its own `replace_with_bnb_linear` on the
blocks, each weight then quantized by bitsandbytes on the move. (diffusers refuses bitsandbytes
without a GPU in `from_pretrained`; the replacement and the layers are the same.)

Rank-16 LoRA (gaussian init, alpha 16) on the layers both models hold one for one: attention
outputs, MLPs, modulations, the single blocks' linear2 (diffusers' `proj_out`). The fused q/k/v
and `linear1` are left out on both sides (diffusers splits them, so their adapters would differ).
Ours: peft layers made as ldm.lora makes them, with its one-GEMM forward (`ldm.lora_fast`);
diffusers': `transformer.add_adapter(LoraConfig(...))` as its QLoRA Flux example does, the same
adapter values. The same fused AdamW over the adapters (ldm.optim), fp32 compute, velocity MSE;
the two take turns step by step (paired, alternating order). Peak memory of each side in its
own process (RSS high-water mark on CPU, max allocated on CUDA).

    python scripts/benchmark.py --only quant_lora --steps 3 --warmup 1
    python scripts/benchmark_quant_lora.py --kinds int8 --steps 2   # alone
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench_backbone import train_step as backbone_train_step
from benchmark_flux import BATCH, LATENT, NETWORK, TOKENS, diffusers_flux_converter
from benchmark_flux import forward as flux_forward
from benchmark_flux import inputs as flux_inputs


def train_step(model, optimizer, batch) -> None:
    backbone_train_step(flux_forward, model, optimizer, batch)


KINDS = ("int8", "nf4", "fp8")
RANK = 16
# Our layer (in a double / single block) -> diffusers' (diffusers' Flux single-file converter).
SAME_LAYERS = {
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "linear2": "proj_out",
    "modulation.lin": "norm.linear",
}
BLOCKS = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}


def flux_models(network: dict):
    """Our Flux and diffusers' FluxTransformer2DModel of `network`'s structure with the same
    weights (scripts/benchmark_flux.py's, at any width: diffusers' own converter)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from ldm.flux import Flux

    torch.manual_seed(0)
    ours = Flux(**network)
    with torch.no_grad():  # moved off the zero-initialised modulations
        for param in ours.parameters():
            param.add_(0.02 * torch.randn(param.shape))
    theirs = FluxTransformer2DModel(
        in_channels=ours.in_channels * 4,
        num_layers=network["depth"],
        num_single_layers=network["depth_single_blocks"],
        attention_head_dim=network["hidden_size"] // network["num_heads"],
        num_attention_heads=network["num_heads"],
        joint_attention_dim=ours.txt_in.in_features,
        pooled_projection_dim=ours.vector_in.in_layer.in_features,
        guidance_embeds=network.get("guidance_embed", False),
        axes_dims_rope=tuple(network.get("axes_dim", (16, 56, 56))),
    )
    convert = diffusers_flux_converter(network["hidden_size"])
    theirs.load_state_dict(convert(dict(ours.state_dict())), strict=True)
    return ours, theirs


def target_pairs(ours) -> dict[str, str]:
    """Our LoRA targets (ldm.flux.lora_targets without the fused layers) -> diffusers' names."""
    from ldm.flux import lora_targets

    pairs = {}
    for name in lora_targets(ours):
        group, index, layer = name.split(".", 2)
        if layer in SAME_LAYERS:
            pairs[name] = f"{BLOCKS[group]}.{index}.{SAME_LAYERS[layer]}"
    return pairs


def lora_config(names: list[str]):
    from peft import LoraConfig

    pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
    return LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=pattern)


def our_quantized_lora(ours, names: list[str], kind: str):
    """Ours as a LoRA run builds it: frozen base, peft adapters (fp32) with ldm.lora_fast's
    forward, then at fit start the blocks quantized (ldm.lora.quantize_blocks)."""
    import torch
    from peft import inject_adapter_in_model

    from ldm import lora, lora_fast

    ours.requires_grad_(False)
    inject_adapter_in_model(lora_config(names), ours)
    for name, param in ours.named_parameters():
        param.requires_grad_("lora_" in name)
    lora_fast.use_fast_forward(ours)
    lora.quantize_blocks(ours, kind, torch.float32)
    return ours


def diffusers_quantized_lora(theirs, names: list[str], kind: str):
    """diffusers' FluxTransformer2DModel quantized on its blocks as from_pretrained does with a
    BitsAndBytesConfig (int8 / nf4; fp8: layerwise casting), then `add_adapter` and the adapters in fp32 (`cast_training_params`), as its training
    examples do."""
    import torch
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.training_utils import cast_training_params

    theirs.requires_grad_(False)
    for blocks in (theirs.transformer_blocks, theirs.single_transformer_blocks):
        if kind == "fp8":
            apply_layerwise_casting(blocks, torch.float8_e4m3fn, torch.float32, ())
        else:
            bnb_quantize(blocks, kind)
    theirs.add_adapter(lora_config(names))
    cast_training_params(theirs, torch.float32)  # peft made them in the stored dtype (fp8)
    return theirs


def bnb_quantize(module, kind: str) -> None:
    """diffusers' bitsandbytes path: `replace_with_bnb_linear` makes empty bitsandbytes layers
    from the config; each is given its weight as bitsandbytes' parameter (as the quantizer's
    `create_quantized_param`), which quantizes when moved to the device."""
    import bitsandbytes as bnb
    import torch
    from diffusers import BitsAndBytesConfig
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear

    if kind == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    linears = {
        name: (m.weight.detach(), m.bias)
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    replace_with_bnb_linear(module, modules_to_not_convert=[], quantization_config=config)
    for name, (weight, bias) in linears.items():
        layer = module.get_submodule(name)
        if kind == "int8":
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, compress_statistics=True, quant_type="nf4"
            )
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        layer.to(weight.device)  # bitsandbytes quantizes on the move


def build(kind: str, device, network: dict = NETWORK):
    """(ours, diffusers') LoRA models on a `kind` base: the same weights, targets and adapters."""
    import torch

    ours, theirs = flux_models(network)
    pairs = target_pairs(ours)
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    for our_name, their_name in pairs.items():  # the pairs are the same layers
        assert torch.equal(ours_state[f"{our_name}.weight"], theirs_state[f"{their_name}.weight"])
    ours = our_quantized_lora(ours, list(pairs), kind)
    theirs = diffusers_quantized_lora(theirs, list(pairs.values()), kind)
    torch.manual_seed(1)
    with torch.no_grad():  # the same non-zero adapters: both compute the same function
        for our_name, their_name in pairs.items():
            ours_layer, their_layer = ours.get_submodule(our_name), theirs.get_submodule(their_name)
            for part in ("lora_A", "lora_B"):
                value = 0.01 * torch.randn(getattr(ours_layer, part)["default"].weight.shape)
                getattr(ours_layer, part)["default"].weight.copy_(value)
                getattr(their_layer, part)["default"].weight.copy_(value)
    counts = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (ours, theirs)]
    assert counts[0] == counts[1] > 0, counts
    return ours.to(device).train(), theirs.to(device).train()


def optimizer(model):
    from ldm.optim import build_optimizer

    return build_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def memory_child(which: str, kind: str, device, network: dict) -> None:
    """Its own process: the peak memory of one step of one side (after a step that makes the
    optimizer state), printed as JSON."""
    import torch
    from bench_common import _proc_status

    ours, theirs = build(kind, device, network)
    model = ours if which == "ours" else theirs
    del ours, theirs
    opt, batch = optimizer(model), flux_inputs(device)
    train_step(model, opt, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        train_step(model, opt, batch)
        peak = torch.cuda.max_memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        train_step(model, opt, batch)
        peak = _proc_status("VmHWM")
    print(json.dumps({"peak": peak}))


def peak_memory(which: str, kind: str, device, network: dict) -> int:
    command = [sys.executable, __file__, "--memory-child", which, kind, "--device", str(device)]
    out = subprocess.run(
        [*command, "--network", json.dumps(network)],
        capture_output=True,
        text=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    if out.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def quant_lora_section(args, device, kinds=KINDS, network: dict = NETWORK) -> list[str]:
    import torch
    from benchmark_lora import paired_seconds

    rows = [
        f"| Flux.1-dev-structure LoRA step on a quantized base (rank {RANK}, batch {BATCH}, "
        f"{LATENT}x{LATENT}x16, {TOKENS} text tokens, width {network['hidden_size']}, "
        f"{network['depth']} double + {network['depth_single_blocks']} single blocks) | img/s "
        "| speed vs diffusers+peft+bnb (median of pairs, range) | peak memory | memory vs theirs |",
        "|---|---|---|---|---|",
    ]
    batch = flux_inputs(device)
    for kind in kinds:
        peaks = {w: peak_memory(w, kind, device, network) for w in ("diffusers", "ours")}
        models = dict(zip(("ours", "diffusers"), build(kind, device, network)))
        with torch.no_grad():
            out = flux_forward(models["ours"], batch)
            gap = (out - flux_forward(models["diffusers"], batch)).abs().max().item()
        print(f"{kind}: outputs ours - diffusers max |diff| {gap:.2e}", flush=True)
        steps = {
            label: lambda m=model, o=optimizer(model): train_step(m, o, batch)
            for label, model in models.items()
        }
        times = paired_seconds(steps, device, args.steps, args.warmup)
        pairs = sorted(d / o for d, o in zip(times["diffusers"], times["ours"]))
        speed = {
            "diffusers": "1.00x",
            "ours": f"{statistics.median(pairs):.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f})",
        }
        for label in ("diffusers", "ours"):
            rows.append(
                f"| {kind} {label} | {BATCH / statistics.median(times[label]):.3f} | "
                f"{speed[label]} | {peaks[label] / 2**20:.0f} MiB | "
                f"{peaks[label] / peaks['diffusers']:.2f}x |"
            )
            print(rows[-1], flush=True)
        del models, steps
    return rows


def main(argv=None) -> None:
    import argparse

    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--memory-child", nargs=2, metavar=("SIDE", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--network", type=json.loads, default=NETWORK, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.memory_child:
        memory_child(*args.memory_child, device, args.network)
        return
    print("\n".join(quant_lora_section(args, device, args.kinds, args.network)))


if __name__ == "__main__":
    main()
