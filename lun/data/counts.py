"""A dataset's counts (lun.data.local.Local's `counts`: found, dropped by each rule, indexed,
usable), one line each: logged where the DataModule builds a split, and listed by the dataset
report."""

import logging

logger = logging.getLogger("lun.data")


def count_lines(name: str, counts: dict) -> list[str]:
    """One line per count of a dataset's `counts` (lun.data.local.Local): found, each drop
    reason, indexed, usable, each problem of a kept item."""
    lines = [f"{name}: found {counts['found']}"]
    lines += [f"{name}: dropped {n} {reason}" for reason, n in counts["dropped"].items()]
    lines += [f"{name}: indexed {counts['indexed']}, usable {counts.get('usable', 0)}"]
    lines += [f"{name}: kept {n} with {problem}" for problem, n in counts["noted"].items()]
    return lines


def log_counts(name: str, dataset) -> None:
    """The counts at the start of a training run (called where the DataModule builds a split)."""
    counts = getattr(dataset, "counts", None)
    for line in count_lines(name, counts) if counts is not None else ():
        logger.info(line)
