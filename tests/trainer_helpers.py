"""A Lightning Trainer for the tests that fit in this process."""

import lightning.pytorch as pl

# What such a test does not ask for: no logger, checkpoints, progress bar or model summary.
QUIET = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer that writes and shows nothing but what `kwargs` add (or override)."""
    return pl.Trainer(**{**QUIET, **kwargs})
