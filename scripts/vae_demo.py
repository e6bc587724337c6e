"""CPU demo of the autoencoder trainer: train a tiny KL-VAE on plain-background shapes, then
fine-tune only its decoder on a new domain (textured backgrounds), as sd-vae-ft-mse was made;
held-out reconstruction PSNR before and after each stage, against a control (the same
decoder-only steps on plain images), and the encoder (the latent space) checked unchanged.

    nice -n 10 python scripts/vae_demo.py      # 16x16 images: minutes on 2 idle CPU cores

The loss is the recipe's L1 + KL (1e-6); LPIPS and the discriminator are off (with random VGG
weights LPIPS means nothing, and the GAN needs far longer runs than a demo).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ldm.autoencoder_training import AutoencoderKLTraining


import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from make_shapes import make_shapes
from PIL import Image

DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=16, in_channels=3, out_ch=3, ch=32,
    ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
LOSS = {
    "target": "ldm.vae_loss.LPIPSWithDiscriminator",
    "params": {
        "disc_start": 10**9,
        "kl_weight": 1e-6,
        "perceptual_weight": 0.0,
        "disc_ndf": 8,
        "disc_num_layers": 2,
    },
}


def load_domains(folder: Path, n: int, size: int, seed: int) -> dict[str, torch.Tensor]:
    """Shapes images split by background: {"plain": (N, 3, H, W), "textured": ...} in [-1, 1]."""
    import torch

    shown = make_shapes(folder, n=n, size=size, seed=seed)
    domains = {"plain": [], "textured": []}
    for item in shown:
        pixels = np.asarray(Image.open(folder / "images" / f"{item.name}.png"), dtype=np.float32)
        image = torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1)
        domains["textured" if item.textured else "plain"].append(image)
    return {k: torch.stack(v) for k, v in domains.items()}


def split(images: torch.Tensor, held_out: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(images) * (1 - held_out))
    return images[:cut], images[cut:]


def mean_psnr(vae: AutoencoderKLTraining, images: torch.Tensor) -> float:
    import torch

    from ldm.autoencoder_training import psnr

    vae.eval()
    with torch.no_grad():
        recs, _ = vae(images, sample_posterior=False)
    vae.train()
    return float(psnr(images, recs).mean())


def train(vae: AutoencoderKLTraining, images: torch.Tensor, steps: int, batch: int) -> float:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    data = DataLoader([{"image": x} for x in images], batch_size=batch, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(vae, data)
    return time.perf_counter() - start


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--n", type=int, default=240, help="images generated (30%% textured)")
    parser.add_argument("--steps", type=int, default=1500, help="stage 1 (whole VAE) steps")
    parser.add_argument("--finetune-steps", type=int, default=300, help="stage 2 steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch  # after parsing: --help answers at once

    from ldm.autoencoder_training import AutoencoderKLTraining

    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        domains = load_domains(Path(tmp), args.n, DDCONFIG["resolution"], args.seed)
    plain_train, plain_test = split(domains["plain"])
    tex_train, tex_test = split(domains["textured"])
    print(f"plain: {len(plain_train)} train / {len(plain_test)} held out; "
          f"textured: {len(tex_train)} / {len(tex_test)}")  # fmt: skip

    def report(stage: str, vae) -> None:
        print(f"{stage:<34} PSNR plain {mean_psnr(vae, plain_test):6.2f} dB | "
              f"textured {mean_psnr(vae, tex_test):6.2f} dB", flush=True)  # fmt: skip

    vae = AutoencoderKLTraining(DDCONFIG, LOSS, embed_dim=4, learning_rate=args.lr)
    report("random init", vae)
    seconds = train(vae, plain_train, args.steps, args.batch)
    report(f"stage 1: {args.steps} steps on plain", vae)
    print(f"  ({seconds:.0f} s)")

    def decoder_only():
        tuned = AutoencoderKLTraining(
            DDCONFIG, LOSS, embed_dim=4, learning_rate=args.lr, train_decoder_only=True
        )
        tuned.load_state_dict(vae.state_dict())
        return tuned

    # The control: the same decoder-only steps on plain images. What the textured fine-tune
    # gains over it on textured images is domain adaptation, not just more training.
    control = decoder_only()
    train(control, plain_train, args.finetune_steps, args.batch)
    report(f"control: decoder-only {args.finetune_steps} steps on plain", control)
    tuned = decoder_only()
    encoder = {k: v.clone() for k, v in tuned.encoder.state_dict().items()}
    seconds = train(tuned, tex_train, args.finetune_steps, args.batch)
    report(f"stage 2: decoder-only {args.finetune_steps} steps on textured", tuned)
    print(f"  ({seconds:.0f} s)")
    same = all(torch.equal(encoder[k], v) for k, v in tuned.encoder.state_dict().items())
    print(f"encoder unchanged by the fine-tune (latent space kept): {same}")


if __name__ == "__main__":
    main()
