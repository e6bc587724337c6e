"""The callbacks every run gets, as `{name: {target, params}}` the launcher merges with the user's.

A user's `lightning.callbacks.<name>` overrides the default of the same name (`null` removes it).
Names follow the original CompVis `main.py` where the role is the same (`learning_rate_logger`,
`metrics_over_trainsteps_checkpoint`, `modelcheckpoint`, `image_logger`), so overrides written
for the original configs land on the matching callback.

EMA, the image logger and the evaluation are opt-in. In a config:

    lightning:
      callbacks:
        ema:
          target: lun.callbacks.ema.EMA
          params:
            decay: 0.9999        # per optimizer step
            update_every: 10     # fold in every 10 steps (decay^10), less CPU time
            warmup: litema       # litema | power | none
        image_logger:
          target: lun.callbacks.image_logger.ImageLogger
          params:
            batch_frequency: 2000
            max_images: 4
            prompts: ["a photo of a cat", "a watercolor of a lighthouse"]
            seed: 0
            sampler: ddim
            steps: 20
            scale: 5.0
            log_first_step: true
            reconstructions: true
        evaluation:                    # FID / KID / CLIP score (lun.callbacks.evaluation)
          target: lun.callbacks.evaluation.Evaluation
          params: {reference: real/, features: pt_inception.pth, prompts: prompts.txt}
        best_fid:                      # the checkpoint with the lowest eval/fid
          target: lun.callbacks.checkpoints.Checkpoint
          params: {monitor: eval/fid, mode: min, every_n_train_steps: 5000, filename: best-fid}
        modelcheckpoint:               # the frequent checkpoint
          params:
            every_n_train_steps: 5000  # its file is then `every-5k-steps.ckpt`
        metrics_over_trainsteps_checkpoint: null   # keep no periodic checkpoints
        throughput: null                           # no img/s, MFU, data-wait figures
"""

import os

ROLE_TARGETS = {
    "progress_bar": "lun.callbacks.progress.SmoothedProgressBar",
    "checkpoint": "lun.callbacks.checkpoints.Checkpoint",
    "learning_rate_logger": "lightning.pytorch.callbacks.LearningRateMonitor",
    "epoch_stats": "lun.callbacks.epoch_stats.EpochStats",
    "nan_guard": "lun.callbacks.nan_guard.NaNGuard",
    "ema": "lun.callbacks.ema.EMA",
    "rng_state": "lun.callbacks.rng_state.RNGState",
    "throughput": "lun.callbacks.throughput.Throughput",
}


def default_callback_configs(
    run_dir: str, has_validation: bool, monitor: str = "val/loss", use_ema: bool = False
) -> dict[str, dict]:
    """Default callbacks of a run whose files live in `run_dir` (`logs/<run>`).

    - `throughput`: images/s, MFU, data-wait fraction and peak memory (progress bar, TensorBoard,
      epoch line) and a throughput report at the end; first, so the others show this step's.
    - `progress_bar`: smoothed loss, it/s, images/s, ETA, LR, peak memory.
    - `modelcheckpoint`: every 2000 steps into `every-2k-steps.ckpt`, overwritten each time, with
      `last.ckpt` a link to it; also written when training ends.
    - `metrics_over_trainsteps_checkpoint`: every 10000 steps a kept `step-000010000.ckpt`.
    - `best_checkpoint` (only with validation): `best.ckpt`, the lowest `monitor`.
    - `learning_rate_logger`, `epoch_stats` (time and peak memory per epoch), `nan_guard`
      (skips NaN/inf steps, stops after 20 in a row with `last-good.ckpt`).
    - `rng_state`: the random-number streams of every rank in each checkpoint, put back on resume
      (with the data position, optimizer and EMA this makes a resume bitwise exact).
    - `ema` only when `use_ema` (the model config's `use_ema`), updated every step.
    """
    checkpoints = os.path.join(run_dir, "checkpoints")
    configs = {
        "throughput": {"target": ROLE_TARGETS["throughput"], "params": {}},
        "progress_bar": {
            "target": ROLE_TARGETS["progress_bar"],
            "params": {"log_every_n_steps": 50},
        },
        "modelcheckpoint": {
            "target": ROLE_TARGETS["checkpoint"],
            "params": {
                "dirpath": checkpoints,
                "every_n_train_steps": 2000,
                "save_top_k": 1,
                "save_last": "link",
                "save_on_train_end": True,
            },
        },
        "metrics_over_trainsteps_checkpoint": {
            "target": ROLE_TARGETS["checkpoint"],
            "params": {"dirpath": checkpoints, "every_n_train_steps": 10000, "save_top_k": -1},
        },
        "learning_rate_logger": {
            "target": ROLE_TARGETS["learning_rate_logger"],
            "params": {"logging_interval": "step"},
        },
        "epoch_stats": {"target": ROLE_TARGETS["epoch_stats"], "params": {}},
        "rng_state": {"target": ROLE_TARGETS["rng_state"]},
        "nan_guard": {
            "target": ROLE_TARGETS["nan_guard"],
            "params": {"max_consecutive": 20, "dirpath": checkpoints},
        },
    }
    if has_validation:
        configs["best_checkpoint"] = {
            "target": ROLE_TARGETS["checkpoint"],
            "params": {"dirpath": checkpoints, "monitor": monitor, "mode": "min", "save_top_k": 1},
        }
    if use_ema:
        # Every step by default: `update_every: auto` (N from the measured copy+fold and step
        # times, <= 3 % of the step) depends on timings, so two runs may average differently;
        # it is the users' choice (docs/performance.md), not the default.
        configs["ema"] = {"target": ROLE_TARGETS["ema"], "params": {}}
    return configs
