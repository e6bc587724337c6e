"""scripts/benchmark.py's dit section: a DiT training step of ours against diffusers'.

One DiT-S/2 and DiT-B/2 training step (forward, MSE on all 8 output channels, backward, the
same fused AdamW, grads set to None) of `ldm.dit` against diffusers' DiTTransformer2DModel
holding the same weights (ldm.layout.dit.dit_to_diffusers). Both in train mode, SDPA attention,
GELU-tanh, no gradient checkpointing, no EMA; diffusers' own class-label dropout (drawn in every
block while training) is off, as ours leaves it to the conditioner, so both compute the same
function. The two sides take turns in A B B A order, so
neither always runs right after the other.

`--cpu-seconds` times each step in process CPU seconds on one thread instead of the wall clock
(the matmul peak too): on a machine shared with other jobs the wall clock of a step swings
several-fold with the load, the CPU time it needs much less.
"""

from __future__ import annotations

import statistics
import time

from bench_common import DTYPES, LATENT, cpu_has_bf16, synchronize

# DiT rows: (preset, batch, latent side). DiT-B/2 does 4x DiT-S/2's work per token; on a CPU
# it runs at batch 2 on 16x16 latents (64 tokens, 128 px images) so the section ends in minutes.
DIT_ROWS = {"cuda": [("DiT_S_2", 4, 32), ("DiT_B_2", 4, 32)]}
DIT_ROWS["cpu"] = [("DiT_S_2", 4, 32), ("DiT_B_2", 2, 16)]


def build_dits(preset: str, device, latent: int = LATENT):
    """Our DiT preset and diffusers' DiTTransformer2DModel of the same size and weights."""
    import torch
    from diffusers import DiTTransformer2DModel

    from ldm import dit
    from ldm.layout.dit import dit_to_diffusers

    torch.manual_seed(0)
    ours = getattr(dit, preset)(input_size=latent, num_classes=1000)
    width, heads = ours.pos_embed.shape[-1], ours.blocks[0].attn.num_heads
    theirs = DiTTransformer2DModel(
        num_attention_heads=heads,
        attention_head_dim=width // heads,
        in_channels=4,
        out_channels=8,
        num_layers=len(ours.blocks),
        sample_size=latent,
        patch_size=ours.patch_size,
        num_embeds_ada_norm=1000,
        norm_eps=1e-6,
    )
    theirs.load_state_dict(dit_to_diffusers(ours.state_dict()))
    for block in theirs.transformer_blocks:  # same function: ours leaves label dropout to the
        block.norm1.emb.class_embedder.dropout_prob = 0.0  # conditioner (ClassLabels.ucg_rate)
    return ours.to(device).train(), theirs.to(device).train()


def dit_train_step(run, model, optimizer, target, dtype) -> None:
    import torch
    import torch.nn.functional as F

    with torch.autocast(target.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = F.mse_loss(run(model).float(), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def turns_median_seconds(steps: dict, device, repeats: int, warmup: int, clock) -> dict:
    """Median seconds (by `clock`) of each callable, taking turns in A B B A ... order."""
    times = {label: [] for label in steps}
    order = list(steps)
    for repeat in range(warmup + repeats):
        for label in order if repeat % 2 == 0 else order[::-1]:
            synchronize(device)
            start = clock()
            steps[label]()
            synchronize(device)
            if repeat >= warmup:
                times[label].append(clock() - start)
    return {label: statistics.median(seconds) for label, seconds in times.items()}


def matmul_peak(device, dtype, clock, n=2048, reps=10) -> float:
    """FLOP/s of a large square matmul: the machine's practical peak at this dtype."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = turns_median_seconds({"mm": lambda: a @ b}, device, reps, 2, clock)["mm"]
    return 2 * n**3 / seconds


def dit_section(args, device) -> list[str]:
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ldm.optim import build_optimizer

    cpu_seconds = getattr(args, "cpu_seconds", False) and device.type == "cpu"
    if cpu_seconds:
        torch.set_num_threads(1)  # process time is then the step's own time
    clock = time.process_time if cpu_seconds else time.perf_counter
    speed = "img/CPU-s (1 thread)" if cpu_seconds else "img/s"
    rows = [
        f"| DiT train step | batch, latent | dtype | {speed} | vs diffusers | fwd GFLOP/img | TFLOP/s | of matmul peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dtypes = [d for d in args.dtypes if d == "fp32" or device.type == "cuda" or cpu_has_bf16()]
    for preset, batch, latent in DIT_ROWS.get(device.type, DIT_ROWS["cuda"]):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 4, latent, latent, generator=g).to(device)
        t = torch.randint(0, 1000, (batch,), generator=g).to(device)
        y = torch.randint(0, 1000, (batch,), generator=g).to(device)
        target = torch.randn(batch, 8, latent, latent, generator=g).to(device)
        runs = {
            "ours": lambda m, x=x, t=t, y=y: m(x, t, {"y": y}),
            "diffusers": lambda m, x=x, t=t, y=y: m(x, timestep=t, class_labels=y).sample,
        }
        models = dict(zip(("ours", "diffusers"), build_dits(preset, device, latent)))
        flops, forward_flops = {}, {}
        for label, model in models.items():
            with FlopCounterMode(display=False) as counter:
                out = runs[label](model)
            forward_flops[label] = counter.get_total_flops()
            with FlopCounterMode(display=False) as counter:
                F.mse_loss(runs[label](model).float(), target).backward()
            flops[label] = counter.get_total_flops()
            model.zero_grad(set_to_none=True)
            del out
        optimizers = {
            label: build_optimizer(m.parameters(), lr=1e-4) for label, m in models.items()
        }
        for name in dtypes:
            dtype = getattr(torch, DTYPES[name])
            peak = matmul_peak(device, dtype, clock)
            steps = {
                label: lambda r=runs[label], m=models[label], o=optimizers[label], d=dtype, y=target: (
                    dit_train_step(r, m, o, y, d)
                )
                for label in ("diffusers", "ours")
            }
            results = turns_median_seconds(steps, device, args.steps, args.warmup, clock)
            for label in ("diffusers", "ours"):
                achieved = flops[label] / results[label]
                rows.append(
                    f"| {preset.replace('_', '-', 1).replace('_', '/')} {label} | "
                    f"{batch}, {latent}x{latent}x4 | {name} | "
                    f"{batch / results[label]:.2f} | {results['diffusers'] / results[label]:.2f}x | "
                    f"{forward_flops[label] / batch / 1e9:.1f} | {achieved / 1e12:.3f} | "
                    f"{achieved / peak:.0%} |"
                )
                print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":  # alone: benchmark.py's dit table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(dit_section)
