"""scripts/benchmark.py's flux section: a Flux.1-structure training step, ours against diffusers'.

Flux.1-dev (ldm.flux) at reduced size: width 768 (6 heads of 128, RoPE axes 16/56/56 as
released), 2 double-stream and 4 single-stream blocks instead of 19 and 38, guidance input, T5
width 4096 and CLIP-L 768 kept; batch 1 of 32x32x16 latents (256 image tokens, a 512 px image)
and 64 text tokens. diffusers' FluxTransformer2DModel in the same structure holds our weights
(diffusers' own single-file converter, run with the reduced width in place of its hard-coded
3072). Both take the same inputs - diffusers' as FluxPipeline packs them, with its position ids -
and the same fused AdamW (ldm.optim), fp32, flow-matching MSE on the velocity; they take turns
step by step.

    python scripts/benchmark.py --only flux --steps 3 --warmup 1
"""

from __future__ import annotations

import inspect

from benchmark import alternated_median_seconds

NETWORK = dict(
    depth=2,
    depth_single_blocks=4,
    hidden_size=768,
    num_heads=6,
    guidance_embed=True,
)
BATCH, LATENT, TOKENS = 1, 32, 64


def diffusers_flux_converter(width: int):
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers, its released width
    (`inner_dim = 3072`, where it cuts `single_blocks.N.linear1`) replaced by `width`."""
    from diffusers.loaders import single_file_utils

    convert = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    source = inspect.getsource(convert)
    if source.count("inner_dim = 3072") != 1:
        raise RuntimeError("diffusers' Flux converter changed: revisit diffusers_flux_converter")
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), namespace)  # noqa: S102
    return namespace[convert.__name__]


def build_flux_models(device):
    """Our Flux and diffusers' FluxTransformer2DModel with the same weights (moved by seeded
    noise: the zero-initialised modulations would leave the blocks idle)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from ldm.flux import Flux

    torch.manual_seed(0)
    ours = Flux(**NETWORK)
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(0.02 * torch.randn(param.shape))
    theirs = FluxTransformer2DModel(
        in_channels=64,
        num_layers=NETWORK["depth"],
        num_single_layers=NETWORK["depth_single_blocks"],
        attention_head_dim=NETWORK["hidden_size"] // NETWORK["num_heads"],
        num_attention_heads=NETWORK["num_heads"],
        guidance_embeds=True,
    )
    convert = diffusers_flux_converter(NETWORK["hidden_size"])
    theirs.load_state_dict(convert(dict(ours.state_dict())), strict=True)
    return ours.to(device).train(), theirs.to(device).train()


def flux_inputs(device):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 16, LATENT, LATENT, generator=g)
    t = torch.rand(BATCH, generator=g) * 1000
    context = torch.randn(BATCH, TOKENS, 4096, generator=g)
    pooled = torch.randn(BATCH, 768, generator=g)
    guidance = torch.full((BATCH,), 3.5)
    target = torch.randn(x.shape, generator=g)
    return [v.to(device) for v in (x, t, context, pooled, guidance, target)]


def flux_forward(model, batch):
    """(B, 16, H, W) velocity; diffusers' side packed and unpacked as FluxPipeline does."""
    import torch
    from diffusers import FluxPipeline

    x, t, context, pooled, guidance, _ = batch
    if type(model).__name__ != "FluxTransformer2DModel":
        return model(x, t, {"crossattn": context, "vector": pooled, "guidance": guidance})
    b, c, h, w = x.shape
    ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
    out = model(
        hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
        encoder_hidden_states=context,
        pooled_projections=pooled,
        timestep=t / 1000,
        img_ids=ids,
        txt_ids=torch.zeros(context.shape[1], 3, device=x.device),
        guidance=guidance,
        return_dict=False,
    )[0]  # (B, N, 64)
    return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


def flux_train_step(model, optimizer, batch) -> None:
    import torch.nn.functional as F

    F.mse_loss(flux_forward(model, batch), batch[-1]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flux_section(args, device) -> list[str]:
    import torch

    from ldm.optim import build_optimizer

    rows = [
        f"| Flux.1-dev-structure train step (batch {BATCH}, {LATENT}x{LATENT}x16, {TOKENS} text "
        "tokens, width 768, 2 double + 4 single blocks) | dtype | img/s | vs diffusers |",
        "|---|---|---|---|",
    ]
    ours, theirs = build_flux_models(device)
    batch = flux_inputs(device)
    with torch.no_grad():  # the same function: the comparison is of speed alone
        out = flux_forward(ours, batch)
        gap = (out - flux_forward(theirs, batch)).abs().max().item()
    print(
        f"Flux outputs, ours - diffusers: max |diff| {gap:.2e} (mean |out| {out.abs().mean():.2f})",
        flush=True,
    )
    optimizers = {  # the same optimizer on both sides: fused AdamW (ldm.optim)
        "diffusers": build_optimizer(theirs.parameters(), lr=1e-5),
        "ours": build_optimizer(ours.parameters(), lr=1e-5),
    }
    steps = {
        label: lambda m=model, o=optimizers[label]: flux_train_step(m, o, batch)
        for label, model in (("diffusers", theirs), ("ours", ours))
    }
    results = alternated_median_seconds(steps, device, args.steps, args.warmup)
    for label in ("diffusers", "ours"):
        rows.append(
            f"| {label} | fp32 | {BATCH / results[label]:.2f} | "
            f"{results['diffusers'] / results[label]:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":  # alone: benchmark.py's flux table (its flags apply: --help)
    import sys

    from benchmark import main

    main(["--only", "flux", *sys.argv[1:]])
