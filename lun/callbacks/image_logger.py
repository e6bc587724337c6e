"""Sample images during training: fixed prompts and seeds, CFG, EMA weights; PNG + TensorBoard."""

import json
import os
from contextlib import nullcontext

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from lun.callbacks.ema import ema_weights
from lun.callbacks.measure import batch_size_of
from lun.images import make_grid


class ImageLogger(Callback):
    """Every `batch_frequency` optimizer steps, sample a grid with fixed prompts and seed.

    Calls `pl_module.log_images(batch, N, prompts, seed, sampler, steps, scale)` (with
    `reconstructions=True` when asked) in eval mode, without gradients, with the EMA weights when
    there is an EMA callback, and with the global random state saved and restored - so logging
    images never changes the training run. Every rank samples (they would wait for rank 0
    anyway); rank 0 writes `<dirpath>/<kind>_gs-<step>_e-<epoch>.png` (settings in a PNG text
    chunk) and adds the grid to TensorBoard when the trainer logs there.

    Args:
        batch_frequency: optimizer steps between grids.
        max_images: images per grid.
        prompts: fixed prompts, repeated to `max_images`; None = the captions of the current batch.
            Class ids for a class-conditional model (DiT): a fixed class grid.
        seed: seed of the sampling noise (the same each time, so grids are comparable over time).
        sampler, steps, scale: sampler name, sampling steps and classifier-free guidance scale.
        use_ema: sample with the EMA weights when the trainer has an EMA callback.
        log_first_step: also sample before the first optimizer step (the starting model).
        increase_log_steps: also sample at steps 1, 2, 4, 8, ... below `batch_frequency`.
        reconstructions: also log the batch passed through the first stage (VAE sanity check).
        dirpath: where the PNGs go; None = `<trainer.default_root_dir>/images/train`.
    """

    def __init__(
        self,
        batch_frequency: int = 1000,
        max_images: int = 4,
        prompts: list[str] | None = None,
        seed: int = 0,
        sampler: str = "ddim",
        steps: int = 20,
        scale: float = 5.0,
        use_ema: bool = True,
        log_first_step: bool = False,
        increase_log_steps: bool = False,
        reconstructions: bool = False,
        dirpath: str | None = None,
    ):
        if batch_frequency < 1:
            raise ValueError(f"ImageLogger batch_frequency must be >= 1, got {batch_frequency}")
        self.batch_frequency, self.max_images = batch_frequency, max_images
        self.prompts = list(prompts) if prompts else None
        self.seed, self.sampler, self.steps, self.scale = seed, sampler, steps, scale
        self.use_ema, self.log_first_step = use_ema, log_first_step
        self.increase_log_steps, self.reconstructions = increase_log_steps, reconstructions
        self.dirpath = dirpath
        self._last_logged_step: int | None = None

    def is_due(self, step: int) -> bool:
        if step == 0:
            return self.log_first_step
        if self.increase_log_steps and step < self.batch_frequency and step & (step - 1) == 0:
            return True  # a power of two
        return step % self.batch_frequency == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and self.is_due(0):
            self._log_once(trainer, pl_module, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step changes once per optimizer step; `_log_once` ignores the other micro-batches.
        if trainer.global_step > 0 and self.is_due(trainer.global_step):
            self._log_once(trainer, pl_module, batch)

    def _log_once(self, trainer, pl_module, batch) -> None:
        step = trainer.global_step
        if step == self._last_logged_step:
            return
        self._last_logged_step = step
        images, settings = self.sample(trainer, pl_module, batch)
        if trainer.is_global_zero:
            self.write(trainer, images, settings)

    def sample(self, trainer, pl_module, batch) -> tuple[dict[str, torch.Tensor], dict]:
        """Run `log_images` as described in the class docstring; returns (images, settings)."""
        if self.prompts:
            n = self.max_images
            prompts = [self.prompts[i % len(self.prompts)] for i in range(n)]
        else:
            n = min(self.max_images, batch_size_of(batch))
            prompts = None
        kwargs = dict(
            N=n,
            prompts=prompts,
            seed=self.seed,
            sampler=self.sampler,
            steps=self.steps,
            scale=self.scale,
        )
        if self.reconstructions:
            kwargs["reconstructions"] = True
        device = pl_module.device
        rng = torch.random.fork_rng(
            devices=[] if device.type == "cpu" else [device], device_type=device.type
        )
        swap = ema_weights(trainer, pl_module) if self.use_ema else nullcontext()
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), rng, swap:
                images = pl_module.log_images(batch, **kwargs)
        finally:
            pl_module.train(was_training)
        if prompts is None and isinstance(batch, dict) and "caption" in batch:
            prompts = list(batch["caption"])[:n]
        settings = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "prompts": prompts,
            "seed": self.seed,
            "sampler": self.sampler,
            "steps": self.steps,
            "scale": self.scale,
            "ema": self.use_ema,
        }
        return images, settings

    def write(self, trainer, images: dict[str, torch.Tensor], settings: dict) -> list[str]:
        """Save one PNG grid per kind of image and add it to TensorBoard; returns the paths."""
        folder = self.dirpath or os.path.join(trainer.default_root_dir, "images", "train")
        os.makedirs(folder, exist_ok=True)
        info = PngInfo()
        info.add_text("parameters", json.dumps(settings))
        paths = []
        for kind, batch_images in images.items():
            grid = make_grid(batch_images, nrow=self.max_images)
            path = os.path.join(
                folder, f"{kind}_gs-{settings['step']:06d}_e-{settings['epoch']:06d}.png"
            )
            Image.fromarray(grid).save(path, pnginfo=info)
            paths.append(path)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_image(
                        f"train/{kind}", grid, settings["step"], dataformats="HWC"
                    )
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and settings["prompts"]:
                logger.experiment.add_text(
                    "train/prompts", "\n\n".join(map(str, settings["prompts"])), settings["step"]
                )
        return paths
