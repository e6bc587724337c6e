"""Training options through a real Lightning loop and the tiny LatentDiffusion: gradient
accumulation (update and logged loss), gradient clipping, the LR schedule and log cadence per
optimizer step; the launcher's checkpoint names and cadences when the user overrides them; the
image logger's cadence and seed; what val_check_interval counts. References
are the formulas written here (torch's clip_grad_norm_ rule, the documented warm-up), never a
second run of the code under test with the same settings."""

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from callback_testing import TinyDiffusion
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset
from trainer_helpers import quiet_trainer

from ldm.util import instantiate_from_config
from lun.atomic_io import AtomicCheckpointIO
from lun.callbacks.image_logger import ImageLogger
from lun.config import merge_configs, to_container
from lun.run import RunDir
from lun.trainer import build_callbacks

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny" / "ldm.yaml"
LR = 0.5


class Latents(Dataset):
    """Seeded cached latents (used as they are, no VAE) with captions."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        latent = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(index))
        return {"latent": latent, "caption": f"shape {index}"}


def tiny_sgd(*dotlist):
    """The tiny SD with plain SGD (an update linear in the gradient, unlike Adam's first step),
    and each sample's t and noise a function of its latent: a sample draws the same numbers in a
    batch of 4 as in one of 2 accumulated micro-batches. `diffusion_loss` itself is untouched."""
    torch.manual_seed(0)
    overrides = [
        f"model.params.{d}"
        for d in (
            "optimizer_config.target=torch.optim.SGD",
            "optimizer_config.params.weight_decay=0",
            *dotlist,
        )
    ]
    config = to_container(merge_configs([TINY], overrides))["model"]
    config["params"]["learning_rate"] = LR
    model = instantiate_from_config(config)
    latents = {}
    batch_latents = model.batch_latents

    def remembered(batch, generator=None, mean=False):
        latents["z"] = batch_latents(batch, generator, mean)
        return latents["z"]

    model.batch_latents = remembered
    model.objective.sample_t = lambda n, *args, **kwargs: (
        (latents["z"].flatten(1)[:, 0].abs() * 1e4).long() % 1000
    )
    model.objective.draw_noise = lambda z, generator=None: torch.sin(7 * z + 1)
    return model


def weights(model):
    return {n: p.detach().clone() for n, p in model.model.named_parameters()}


class RecordSteps(pl.Callback):
    """The LR and (unclipped) gradients each optimizer step is taken with."""

    def __init__(self):
        self.lrs, self.grads = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.grads.append(
            {n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}
        )


def fit(model, batch_size, steps, callbacks=(), **kwargs):
    loader = DataLoader(Latents(), batch_size=batch_size, shuffle=False)
    trainer = quiet_trainer(max_steps=steps, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, loader)
    return trainer


class Metrics(Logger):
    """Keeps what the trainer logs: {step: {name: value}}."""

    name, version = "metrics", 0

    def __init__(self):
        super().__init__()
        self.by_step = {}

    def log_metrics(self, metrics, step=None):
        self.by_step.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_accumulating_n_batches_is_one_n_times_batch():
    """accumulate_grad_batches=2 with batch 2 takes the same optimizer steps as batch 4, and logs
    the same train/loss (the loss of all 4 samples, not of the last micro-batch)."""
    start = weights(tiny_sgd())
    big, small = tiny_sgd(), tiny_sgd()
    big_log, small_log = Metrics(), Metrics()
    fit(big, batch_size=4, steps=2, logger=big_log, log_every_n_steps=1)
    fit(
        small,
        batch_size=2,
        steps=2,
        accumulate_grad_batches=2,
        logger=small_log,
        log_every_n_steps=1,
    )
    after_big, after_small = weights(big), weights(small)
    assert any(not torch.equal(after_big[n], start[n]) for n in start)  # it trained
    for name in start:
        torch.testing.assert_close(after_small[name], after_big[name], rtol=1e-4, atol=1e-6)
    for step in (0, 1):
        assert small_log.by_step[step]["train/loss"] == pytest.approx(
            big_log.by_step[step]["train/loss"], rel=1e-5
        )


def test_log_every_n_steps_counts_optimizer_steps():
    metrics = Metrics()
    fit(
        tiny_sgd(),
        batch_size=2,
        steps=6,
        accumulate_grad_batches=2,
        logger=metrics,
        log_every_n_steps=3,
    )
    assert sorted(s for s, m in metrics.by_step.items() if "train/loss" in m) == [2, 5]


def test_gradient_clip_val_scales_the_whole_gradient_to_the_norm():
    """torch's clip_grad_norm_: g * min(1, c / (||g|| + 1e-6)), one norm over all parameters."""
    recorder = RecordSteps()
    model = tiny_sgd()
    start = weights(model)
    fit(model, batch_size=4, steps=1, callbacks=[recorder], gradient_clip_val=1e-3)
    grads = recorder.grads[0]
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
    )
    assert norm > 1e-3  # the clip acts
    scale = min(1.0, 1e-3 / (norm.item() + 1e-6))
    after = weights(model)
    for name, grad in grads.items():
        torch.testing.assert_close(
            after[name], start[name] - LR * scale * grad, rtol=1e-4, atol=1e-8
        )


def test_lr_warmup_is_per_optimizer_step_under_accumulation():
    """docs/configs.md: optimizer step k < W trains at lr (k + 1) / W, then the schedule's shape
    (here constant); micro-batches of an accumulated step do not advance it."""
    recorder = RecordSteps()
    model = tiny_sgd(
        "scheduler_config.target=ldm.optim.WarmupScheduler",
        "scheduler_config.params.warmup_steps=4",
    )
    trainer = fit(model, batch_size=2, steps=6, callbacks=[recorder], accumulate_grad_batches=2)
    assert trainer.global_step == 6
    assert recorder.lrs == pytest.approx([LR * f for f in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0)])


# --- the launcher's checkpoints with the cadence overridden --------------------------------------


def test_an_overridden_cadence_renames_the_frequent_checkpoint(tmp_path):
    """`lightning.callbacks.modelcheckpoint.params.every_n_train_steps: 2` over the defaults: a
    6-step run writes `every-2-steps.ckpt` (step 6, with last.ckpt linked to it) and kept
    `step-*.ckpt` at the kept cadence (here 3), not `every-2k-steps.ckpt`."""
    run = RunDir(tmp_path / "run")
    run.create()
    lightning_cfg = {
        "callbacks": {
            "modelcheckpoint": {"params": {"every_n_train_steps": 2}},
            "metrics_over_trainsteps_checkpoint": {"params": {"every_n_train_steps": 3}},
            "progress_bar": None,
            "throughput": None,
            "epoch_stats": None,
            "learning_rate_logger": None,
        }
    }
    callbacks = build_callbacks(lightning_cfg, run, has_validation=False, use_ema=False)
    saves = []

    class Spy(AtomicCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            saves.append((os.path.basename(path), checkpoint["global_step"]))
            super().save_checkpoint(checkpoint, path, storage_options)

    torch.manual_seed(0)
    quiet_trainer(
        max_steps=6,
        callbacks=callbacks,
        enable_checkpointing=True,
        plugins=[Spy()],
        default_root_dir=str(tmp_path),
    ).fit(TinyDiffusion(), DataLoader(_Images(), batch_size=2))
    assert sorted(os.listdir(run.checkpoints)) == [
        "every-2-steps.ckpt",
        "last.ckpt",
        "step-000000003.ckpt",
        "step-000000006.ckpt",
    ]
    assert ("every-2-steps.ckpt", 2) in saves and ("every-2-steps.ckpt", 4) in saves
    assert torch.load(run.checkpoints / "last.ckpt", weights_only=False)["global_step"] == 6


class _Images(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(index)) * 2 - 1
        return {"image": image, "caption": f"caption {index}"}


# --- image logger: cadence in optimizer steps, the same seed every time --------------------------


def test_image_logger_samples_every_n_optimizer_steps_with_its_seed(tmp_path):
    calls = []
    module = TinyDiffusion()
    original = module.log_images

    def log_images(*args, **kwargs):
        calls.append((module.trainer.global_step, kwargs["seed"], kwargs["prompts"]))
        return original(*args, **kwargs)

    module.log_images = log_images
    logger = ImageLogger(
        batch_frequency=2,
        max_images=2,
        prompts=["a cat"],
        seed=7,
        steps=2,
        log_first_step=True,
        dirpath=str(tmp_path),
    )
    torch.manual_seed(0)
    quiet_trainer(max_steps=6, callbacks=[logger], accumulate_grad_batches=2).fit(
        module, DataLoader(_Images(), batch_size=1)
    )
    assert [step for step, _, _ in calls] == [0, 2, 4, 6]
    assert {seed for _, seed, _ in calls} == {7} and calls[0][2] == ["a cat", "a cat"]
    written = sorted(f.split("_e-")[0] for f in os.listdir(tmp_path) if f.startswith("samples"))
    assert written == [f"samples_gs-{s:06d}" for s in (0, 2, 4, 6)]


def test_a_save_trigger_of_the_users_replaces_the_default_checkpoints(tmp_path):
    """docs/configs.md: `save_every_n_samples` (or `every_n_epochs`) on the default
    `modelcheckpoint` replaces its every-2000-steps cadence; both were refused together
    ("cannot be combined with every_n_train_steps", a key the user never set)."""
    run = RunDir(tmp_path / "run")

    def checkpoint_with(params):
        callbacks = build_callbacks(
            {"callbacks": {"modelcheckpoint": {"params": params}}}, run, False, False
        )
        return [c for c in callbacks if getattr(c, "filename", "").startswith("every-")][0]

    by_samples = checkpoint_with({"save_every_n_samples": 1000})
    assert by_samples.filename == "every-1k-samples"
    by_epochs = checkpoint_with({"every_n_epochs": 1})
    assert (by_epochs._every_n_epochs, by_epochs._every_n_train_steps) == (1, 0)
    assert checkpoint_with({})._every_n_train_steps == 2000  # untouched without a trigger
    assert checkpoint_with({"save_last": False})._every_n_train_steps == 2000


def test_val_check_interval_counts_micro_batches():
    """docs/validation.md: under accumulate_grad_batches 2, val_check_interval 2 validates after
    every optimizer step (Lightning counts training batches)."""

    class Validations(pl.Callback):
        steps = []

        def on_validation_epoch_start(self, trainer, pl_module):
            self.steps.append(trainer.global_step)

    seen = Validations()
    torch.manual_seed(0)
    quiet_trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[seen],
    ).fit(TinyDiffusion(), DataLoader(_Images(), batch_size=2), DataLoader(_Images(), batch_size=2))
    assert seen.steps == [1, 2, 3]
