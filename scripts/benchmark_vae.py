"""scripts/benchmark.py's vae section: a KL-autoencoder training step of ours against diffusers'."""

from __future__ import annotations

from bench_common import (
    BATCH,
    DTYPES,
    alternated_median_seconds,
    cpu_has_bf16,
)

VAE_DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=64, in_channels=3, out_ch=3, ch=64,
    ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
VAE_LOSS = {  # L1 + KL (1e-6); no LPIPS, no discriminator (disc_start never reached) on either side
    "target": "ldm.vae_loss.LPIPSWithDiscriminator",
    "params": {"disc_start": 10**9, "kl_weight": 1e-6, "perceptual_weight": 0.0},
}


def build_vaes(device):
    """Our VAE trainer and diffusers' AutoencoderKL holding the same weights."""
    import torch
    from diffusers import AutoencoderKL

    from ldm.autoencoder_training import autoencoder_kl
    from ldm.layout import diffusers_vae

    torch.manual_seed(0)
    ours = autoencoder_kl(ddconfig=VAE_DDCONFIG, lossconfig=VAE_LOSS, embed_dim=4)
    weights = {k: v for k, v in ours.state_dict().items() if not k.startswith("loss.")}
    config = diffusers_vae.diffusers_config(weights, 0.18215, VAE_DDCONFIG["resolution"])
    config.pop("_class_name")
    theirs = AutoencoderKL(**config)
    theirs.load_state_dict(diffusers_vae.to_diffusers(weights))
    return ours.to(device).train(), theirs.to(device).train()


def vae_losses(device):
    """One training step of each side: encode, sample, decode, the same L1 + KL loss (ours:
    the trainer's generator loss; diffusers': the formula with its own KL), backward, Adam."""
    import torch

    def ours_loss(model, x):
        recs, posterior = model(x)
        return model.loss.generator_loss(x, recs, posterior, step=0)[0]

    def diffusers_loss(model, x):
        posterior = model.encode(x).latent_dist
        recs = model.decode(posterior.sample()).sample
        with torch.autocast(device.type, enabled=False):
            nll = (x - recs.float()).abs().sum() / len(x)  # logvar 0, as ours starts
            return nll + VAE_LOSS["params"]["kl_weight"] * posterior.kl().float().mean()

    return {"ours": ours_loss, "diffusers": diffusers_loss}


def vae_train_step(loss_fn, model, optimizer, x, dtype) -> None:
    import torch

    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(model, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def vae_section(args, device) -> list[str]:
    import torch

    rows = [
        "| VAE train step (batch 4, 64x64, ch 64, L1 + KL) | dtype | img/s | vs diffusers |",
        "|---|---|---|---|",
    ]
    models = dict(zip(("ours", "diffusers"), build_vaes(device)))
    x = (torch.rand(BATCH, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(
        device
    )
    losses = vae_losses(device)
    torch.manual_seed(1)
    first = {label: float(losses[label](m, x)) for label, m in models.items()}
    print(f"VAE first-step loss (different posterior samples): {first}", flush=True)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    optimizers = {  # the recipe's Adam (0.5, 0.9) on the encoder and decoder, both sides
        "ours": models["ours"].configure_optimizers()[0],
        "diffusers": torch.optim.Adam(
            models["diffusers"].parameters(), lr=4.5e-6, betas=(0.5, 0.9)
        ),
    }
    # bf16 rows only where bf16 has instructions (a GPU, AVX512-bf16 / AMX): elsewhere the CPU
    # emulates it and the row would measure the emulation.
    dtypes = [d for d in args.dtypes if d == "fp32" or device.type == "cuda" or cpu_has_bf16()]
    if len(dtypes) < len(args.dtypes):
        print("VAE: no bf16 rows: this CPU has no bf16 instructions (avx512_bf16 / amx_bf16)")
    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        steps = {
            label: lambda f=losses[label], m=models[label], o=optimizers[label], d=dtype: (
                vae_train_step(f, m, o, x, d)
            )
            for label in ("diffusers", "ours")
        }
        results = alternated_median_seconds(steps, device, args.steps, args.warmup)
        for label in ("diffusers", "ours"):
            rows.append(
                f"| {label} | {name} | {BATCH / results[label]:.2f} | "
                f"{results['diffusers'] / results[label]:.2f}x |"
            )
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":  # alone: benchmark.py's vae table (its flags apply: --help)
    from bench_common import run_alone

    run_alone(vae_section)
