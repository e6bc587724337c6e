"""A tiny model that keeps the LatentDiffusion contract the callbacks rely on, and test helpers.

The contract: `self.model` holds the trainable UNet (names `diffusion_model.*`),
`self.first_stage_model` the frozen autoencoder, `log_images(batch, N, prompts, seed, sampler,
steps, scale, reconstructions=False)` returns real images (N, 3, H, W) in [-1, 1], `load_state_dict`
ignores `model_ema.*`, training draws its noise from the global RNG and validation logs
`val/loss`. Swapping the `make_module` fixture (conftest.py) for a tiny
`ldm.diffusion.LatentDiffusion` must leave every test unchanged. (A module name of its own, not
`conftest`, so that tests can import it whatever other conftest files pytest has loaded.)
"""

import os
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ldm.model_contract import TrainingContract

IMAGE_SIZE = 8
ROOT = Path(__file__).resolve().parents[3]


def run_two_ranks(script: str, tmp_path: Path, out: Path) -> str:
    """`script` (Python source: argv[1] is this folder, argv[2] `out`) run as 2 processes under
    torchrun, as its own job, not forked from pytest (a fork of a process that has run earlier
    tests, their threads possibly holding locks, hung CI); its output, once it exits 0."""
    from run_helpers import TORCHRUN_TWO

    path = tmp_path / "two_ranks.py"
    path.write_text(script)
    result = subprocess.run(
        [*TORCHRUN_TWO, str(path), str(Path(__file__).parent), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


class TinyDiffusion(TrainingContract, pl.LightningModule):
    """A two-layer conv net trained to predict noise (x_t = sqrt(1-s) x + sqrt(s) eps)."""

    def __init__(self, learning_rate: float = 0.05):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 3, 3, padding=1)
        )
        self.first_stage_model = nn.Conv2d(3, 3, 1).requires_grad_(False)  # a frozen "VAE"
        self.learning_rate = learning_rate

    # The contract with lun (lun.contract.TrainableModule).
    default_image_size = 8

    @property
    def ema_module(self) -> nn.Module:
        return self.model

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return 3, height, width

    def diffusion_loss(self, images: torch.Tensor, generator=None) -> torch.Tensor:
        # drawn by the (CPU) generator, then moved where the batch is: the same numbers on the
        # CPU and on an accelerator (the EMA's device-shadow test trains this model there)
        noise = torch.randn(images.shape, generator=generator).to(images.device)
        s = torch.rand(images.shape[0], 1, 1, 1, generator=generator).to(images.device)
        x_t = (1 - s).sqrt() * images + s.sqrt() * noise
        return F.mse_loss(self.model.diffusion_model(x_t), noise)

    def training_step(self, batch, batch_idx):
        loss = self.diffusion_loss(batch["image"])
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["caption"]))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.diffusion_loss(batch["image"], torch.Generator().manual_seed(batch_idx))
        self.log("val/loss", loss, batch_size=len(batch["caption"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate)

    @torch.no_grad()
    def log_images(
        self,
        batch=None,
        N=4,
        prompts=None,
        seed=0,
        sampler="ddim",
        steps=20,
        scale=5.0,
        reconstructions=False,
    ):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(N, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        for _ in range(steps):  # a few denoising steps: the images depend on the weights
            x = x - self.model.diffusion_model(x) / steps
        logs = {"samples": x.clamp(-1, 1)}
        if batch is not None:
            logs["inputs"] = batch["image"][:N]
            if reconstructions:
                logs["reconstructions"] = self.first_stage_model(batch["image"][:N]).clamp(-1, 1)
        return logs

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("model_ema.")}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class RandomImages(Dataset):
    """Seeded images in [-1, 1] with captions; `nan_items` are all-NaN; `same` = one image repeated."""

    def __init__(self, length: int, nan_items=(), same: bool = False):
        self.length, self.nan_items, self.same = length, set(nan_items), same

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(0 if self.same else index)
        image = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=generator) * 2 - 1
        if index in self.nan_items:
            image = torch.full_like(image, float("nan"))
        return {"image": image, "caption": f"caption {0 if self.same else index}"}


class SeedEveryStep(pl.Callback):
    """Seeds the global RNG from the step, so a resumed run draws the same noise as an unbroken one."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.manual_seed(1000 * trainer.global_step + batch_idx)


class WeightRecorder(pl.Callback):
    """Copies of `pl_module.model`'s trainable weights after every optimizer step, by step."""

    def __init__(self):
        self.by_step = {}

    def on_train_start(self, trainer, pl_module):
        self.by_step[trainer.global_step] = trainable_weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step.setdefault(trainer.global_step, trainable_weights(pl_module))


def trainable_weights(pl_module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone().float().cpu()
        for n, p in pl_module.model.named_parameters()
        if p.requires_grad
    }
