"""Image quality during training: FID, KID and CLIP score of generated images, in TensorBoard.

Every `every_n_steps` optimizer steps (and when training ends) the model draws
`num_eval_images` images - prompts from a file, or class ids for a class-conditional model
(DiT) - with fixed seeds, and they are scored against a real image set:

- FID (Heusel et al. 2017) and KID (Binkowski et al. 2018, with its standard deviation over
  subsets) on the features of a local extractor file (FID Inception-v3, or a small classifier of
  your own; lun.eval.features); the real set's features are computed once and cached
  (lun.eval.reference);
- CLIP score (Hessel et al. 2021), prompt-image agreement, with a local CLIP folder (text models).

Logged as `eval/fid`, `eval/kid`, `eval/kid_std`, `eval/clip_score`, `eval/num_images`,
`eval/seconds` (TensorBoard, and `trainer.callback_metrics`, so a checkpoint callback with
`monitor: eval/fid`, `mode: min` keeps the best), with a grid of the first images. With
`weights: [ema, raw]` the raw weights' numbers are `eval/raw/fid`, ...

Images are drawn in batches of `batch_size`; batch b uses seed `seed + b` and runs on rank
b mod world size, so the images do not depend on the number of devices. Features are gathered,
rank 0 computes the metrics and broadcasts them. Sampling goes through the module's `log_images`
(lun.contract), in eval mode, without gradients and with the random state saved and restored.
"""

import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image

from lun.callbacks.ema import ema_weights
from lun.images import make_grid

logger = logging.getLogger(__name__)
WEIGHTS = ("ema", "raw")


def read_prompt_file(path) -> list[str]:
    """One prompt per line, blank lines skipped; ValueError naming the file when it has none."""
    if path is None or not os.path.isfile(path):
        raise ValueError(f"prompts={path}: prompt file not found (one prompt per line)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"prompts={path}: not a UTF-8 text file (one prompt per line)") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts={path}: the prompt file has no prompts")
    return prompts


class Evaluation(Callback):
    """FID / KID / CLIP score of generated images every `every_n_steps` (see the module docstring).

    Args:
        reference: the real images: a folder, or a dataset config {target, params}.
        features: feature-extractor weights file (pytorch-fid's pt_inception-2015-12-05-*.pth,
            or a SmallCNN .safetensors of scripts/shapes_features.py).
        prompts: a text file, one prompt per line, cycled to `num_eval_images`.
        classes: class ids instead of prompts, cycled (class-conditional models).
        every_n_steps: optimizer steps between evaluations.
        num_eval_images: images drawn per evaluation (FID is biased low at small counts:
            compare FIDs at the same count only).
        weights: which weights to score, the first logged as `eval/*`: "ema" (the EMA
            callback's; the raw weights while there is none), "raw".
        sampler, steps, scale: sampler name, sampling steps, classifier-free guidance scale.
        seed: batch b of the images uses seed + b.
        batch_size: images per sampling batch (per device).
        clip: a local CLIP model folder for the CLIP score (text prompts only).
        feature_size: input side of the Inception network (299; the SmallCNN's is in its file).
        reference_images: use at most this many real images (None: all).
        kid_subsets, kid_subset_size: KID's subsets (100 of 1000 as in its paper; smaller
            when there are fewer images).
        grid_images: images in the logged grid (0: none).
        at_end: also evaluate when training ends.
        save_images: also save every drawn image (first weights only) as
            `images/eval/gs-<step>/<index>.png`; image i had input i (cycled) and batch
            i // batch_size's seed.
        cache_dir: where reference features are cached (default $LUN_CACHE_DIR/eval or
            ~/.cache/lun/eval).
    """

    def __init__(
        self,
        reference,
        features: str,
        prompts: str | None = None,
        classes: list[int] | None = None,
        every_n_steps: int = 5000,
        num_eval_images: int = 1000,
        weights: list[str] | tuple[str, ...] = ("ema",),
        sampler: str = "ddim",
        steps: int = 25,
        scale: float = 5.0,
        seed: int = 0,
        batch_size: int = 16,
        clip: str | None = None,
        feature_size: int = 299,
        reference_images: int | None = None,
        kid_subsets: int = 100,
        kid_subset_size: int = 1000,
        grid_images: int = 16,
        at_end: bool = True,
        save_images: bool = False,
        cache_dir: str | None = None,
    ):
        from lun.eval.clip_score import check_clip_folder
        from lun.eval.features import check_features_file

        # ValueErrors name the parameter first: the launcher reports them as config errors.
        for name, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("num_eval_images", num_eval_images, 2),
            ("batch_size", batch_size, 1),
            ("steps", steps, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: expected a whole number >= {low}")
        if (prompts is None) == (classes is None):
            raise ValueError("prompts: give a prompt file or `classes` (class ids), one of them")
        self.prompts = read_prompt_file(prompts) if prompts is not None else None
        if classes is not None and (
            not isinstance(classes, (list, tuple)) or not all(isinstance(c, int) for c in classes)
        ):
            raise ValueError(f"classes={classes!r}: expected a list of class ids")
        weights = [weights] if isinstance(weights, str) else list(weights)
        if (
            not weights
            or any(w not in WEIGHTS for w in weights)
            or len(set(weights)) < len(weights)
        ):
            raise ValueError(f"weights={weights!r}: expected a list of ema and/or raw")
        check_features_file(features)
        if clip is not None:
            check_clip_folder(clip)
            if self.prompts is None:
                raise ValueError("clip: the CLIP score needs text prompts, not class ids")
        if isinstance(reference, str) and not os.path.isdir(reference):
            raise ValueError(f"reference={reference}: no such folder of real images")
        if not isinstance(reference, (str, dict)) or (
            isinstance(reference, dict) and "target" not in reference
        ):
            raise ValueError(f"reference={reference!r}: expected a folder or {{target, params}}")
        self.reference, self.features_path, self.clip_path = reference, features, clip
        self.inputs = self.prompts or list(classes)
        self.every_n_steps, self.num_eval_images = every_n_steps, num_eval_images
        self.weights = weights
        self.sampler, self.steps, self.scale, self.seed = sampler, steps, scale, seed
        self.batch_size, self.feature_size = batch_size, feature_size
        self.reference_images, self.cache_dir = reference_images, cache_dir
        self.kid_subsets, self.kid_subset_size = kid_subsets, kid_subset_size
        self.grid_images, self.at_end, self.save_images = grid_images, at_end, save_images
        self.extractor = self.scorer = None
        self._reference_features: np.ndarray | None = None
        self._last_step: int | None = None
        self.seconds = 0.0  # spent evaluating in this fit
        self._fit_started = 0.0

    # --- hooks -------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.extractor is not None:
            return
        from lun.eval.clip_score import CLIPScorer
        from lun.eval.features import load_features

        self.extractor = load_features(self.features_path, self.feature_size)
        if self.clip_path is not None:
            self.scorer = CLIPScorer(self.clip_path)

    def on_train_start(self, trainer, pl_module) -> None:
        # Here, not in setup: the strategy has put the module on its device by now.
        self.extractor.to(pl_module.device)
        if self.scorer is not None:
            self.scorer.to(pl_module.device)
        self._fit_started = time.perf_counter()
        self.seconds = 0.0
        if trainer.is_global_zero:
            self._load_reference(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.evaluate(trainer, pl_module)
        total = time.perf_counter() - self._fit_started
        if trainer.is_global_zero and total > 0 and self.seconds > 0:
            logger.info(
                "evaluation took %.1f s of %.1f s training (%.1f %%)",
                self.seconds,
                total,
                100 * self.seconds / total,
            )

    # --- the evaluation ----------------------------------------------------------------------
    def _load_reference(self, pl_module) -> np.ndarray:
        if self._reference_features is None:
            from lun.eval.reference import reference_features

            size = pl_module.default_image_size
            features, path, cached = reference_features(
                self.reference, self.extractor, size, self.cache_dir, self.reference_images
            )
            logger.info(
                "eval reference: %d images, %s (%s)",
                len(features),
                path,
                "cached" if cached else "computed",
            )
            self._reference_features = features
        return self._reference_features

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        """Draw, score and log; returns the metrics (the same on every rank)."""
        self._last_step = trainer.global_step
        started = time.perf_counter()
        device = pl_module.device
        rng = torch.random.fork_rng(
            devices=[] if device.type == "cpu" else [device], device_type=device.type
        )
        was_training = pl_module.training
        pl_module.eval()
        metrics, grid = {}, None
        try:
            with torch.no_grad(), rng:
                for i, which in enumerate(self.weights):
                    swap = ema_weights(trainer, pl_module) if which == "ema" else nullcontext()
                    with swap:
                        features, clip, images = self._draw(trainer, pl_module, save=i == 0)
                    prefix = "eval/" if i == 0 else f"eval/{which}/"
                    metrics.update(self._score(trainer, pl_module, features, clip, prefix))
                    if i == 0:
                        grid = images
        finally:
            pl_module.train(was_training)
        self.seconds += time.perf_counter() - started
        metrics["eval/seconds"] = time.perf_counter() - started
        self._log(trainer, metrics, grid)
        return metrics

    def _batches(self, trainer) -> list[tuple[int, list]]:
        """(batch index, inputs) of this rank's batches."""
        n, size = self.num_eval_images, self.batch_size
        inputs = [self.inputs[i % len(self.inputs)] for i in range(n)]
        batches = [(b, inputs[start : start + size]) for b, start in enumerate(range(0, n, size))]
        return batches[trainer.global_rank :: trainer.world_size]

    def _draw(self, trainer, pl_module, save: bool = False):
        """This rank's images -> all ranks' features (in batch order), CLIP scores, and the
        first images (rank 0) for the grid."""
        local, grid = [], None
        for b, inputs in self._batches(trainer):
            images = pl_module.log_images(
                None,
                N=len(inputs),
                prompts=inputs,
                seed=self.seed + b,
                sampler=self.sampler,
                steps=self.steps,
                scale=self.scale,
            )["samples"]
            features = self.extractor(images.to(pl_module.device)).cpu().numpy()
            clip = None
            if self.scorer is not None:
                clip = self.scorer(images.to(pl_module.device), inputs).cpu().numpy()
            local.append((b, features, clip))
            if save and self.save_images:
                self._save(trainer, b, images)
            if grid is None and self.grid_images:
                grid = images[: self.grid_images].float().cpu()
        gathered = sorted(_all_gather(trainer, local), key=lambda item: item[0])
        features = np.concatenate([f for _, f, _ in gathered])
        clip = np.concatenate([c for _, _, c in gathered]) if self.scorer is not None else None
        return features, clip, grid

    def _save(self, trainer, batch_index: int, images) -> None:
        from lun.generation import to_pil

        folder = (
            Path(trainer.default_root_dir) / "images" / "eval" / f"gs-{trainer.global_step:06d}"
        )
        folder.mkdir(parents=True, exist_ok=True)
        for k, image in enumerate(images):
            to_pil(image).save(folder / f"{batch_index * self.batch_size + k:05d}.png")

    def _score(self, trainer, pl_module, features, clip, prefix: str) -> dict[str, float]:
        from lun.eval.fid import fid_kid

        metrics = None
        if trainer.is_global_zero:
            reference = self._load_reference(pl_module)
            scores = fid_kid(
                reference, features, self.kid_subsets, self.kid_subset_size, seed=self.seed
            )
            if clip is not None:
                scores["clip_score"] = float(clip.mean())
            metrics = {prefix + name: value for name, value in scores.items()}
        return trainer.strategy.broadcast(metrics, src=0)

    def _log(self, trainer, metrics: dict[str, float], grid) -> None:
        step = trainer.global_step
        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value, dtype=torch.float32)
        if not trainer.is_global_zero:
            return
        for each in trainer.loggers:
            each.log_metrics(metrics, step=step)
        summary = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items())
        logger.info("eval at step %d: %s", step, summary)
        if grid is None:
            return
        image = make_grid(grid, nrow=min(8, len(grid)))
        folder = os.path.join(trainer.default_root_dir, "images", "eval")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(image).save(os.path.join(folder, f"samples_gs-{step:06d}.png"))
        for each in trainer.loggers:
            if isinstance(each, TensorBoardLogger):
                each.experiment.add_image("eval/samples", image, step, dataformats="HWC")


def _all_gather(trainer, local: list) -> list:
    """Every rank's list of picklable items, concatenated (the items carry their order)."""
    if trainer.world_size == 1:
        return local
    import torch.distributed as dist

    everyone = [None] * trainer.world_size
    dist.all_gather_object(everyone, local)
    return [item for part in everyone for item in part]
