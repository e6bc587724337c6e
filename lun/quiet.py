"""Third-party messages known to be harmless, dropped by their text so a run prints our lines.

Each entry is one message a library prints on every run (or on every Ctrl-C) that asks nothing
of the user: a tip, a deprecation inside Lightning, a note about frozen modules we keep in eval
mode on purpose. Only these texts are dropped - every other warning still shows. `install()` is
called by main.py and the scripts' `__main__` blocks, never at import (a library that imports
us keeps its own warnings).
"""

import logging
import re
import warnings

# logger name -> messages it logs that say nothing to our users (regexes, matched at the start)
LOGGED = {
    # At import of bitsandbytes (peft imports it) on CPUs with avx512bf16: an optional hub kernel
    # for 4-bit CPU inference, which training never uses.
    "bitsandbytes.backends.cpu.ops": [
        r"Failed to load CPU gemm_4bit_forward from kernels-community"
    ],
    # Lightning's rank_zero_info goes through one of these (whichever module set it last).
    "lightning.pytorch.utilities.rank_zero": [
        r"💡 Tip: For seamless cloud logging",  # an advertisement for litlogger
        r"TPU available: False",
        r"HPU available: False",
    ],
    "lightning.fabric.utilities.rank_zero": [r"💡 Tip: For seamless cloud logging"],
    # On Ctrl-C / SIGTERM Lightning saves with weights_only unset and says so; our loader checks
    # every checkpoint it reads (lun.strategies.check_checkpoint), so this is not an unsafe load.
    "lightning.pytorch.trainer.connectors.checkpoint_connector": [r"`weights_only` was not set"],
}

# warnings.warn messages (regexes, matched at the start as `warnings.filterwarnings` does)
WARNED = [
    # Lightning's own use of a torch pytree class that torch deprecated (not our code).
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # The frozen VAE and text encoders are in eval mode on purpose (no dropout, no batch stats).
    r"Found \d+ module\(s\) in eval mode at the start of training",
    # A config without a validation split: the model has a validation_step for those that do.
    r"You defined a `validation_step` but have no `val_dataloader`",
    # Every resumed run: a new run's folder is new (timestamped), so the only non-empty
    # checkpoint folder is a resumed run's own.
    r"Checkpoint directory .* exists and is not empty",
    # A small folder (a tiny config on a few images): our progress line reports every step.
    r"The number of training batches \(\d+\) is smaller than the logging interval",
]


class DropKnown(logging.Filter):
    """Drop a logger's records whose message starts with one of `patterns`."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def install() -> None:
    """Drop the known messages in this process (idempotent). Call before the heavy imports:
    bitsandbytes prints at import."""
    for name, patterns in LOGGED.items():
        logger = logging.getLogger(name)  # made now if not yet imported: the filter waits there
        if not any(isinstance(f, DropKnown) for f in logger.filters):
            logger.addFilter(DropKnown(patterns))
    for pattern in WARNED:
        warnings.filterwarnings("ignore", message=pattern)
