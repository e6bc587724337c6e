"""Bad input is skipped, counted and reported once per file - training goes on.

Index-time problems (zero-byte files, malformed JSON, missing fields) are met in the main process.
Load-time problems (an undecodable image) are met in DataLoader workers, so the "already reported"
flag of each item lives in a shared-memory tensor: a file is logged once per run however many
workers and epochs meet it, and the main process can count them for the end-of-epoch summary.
"""

import logging
from collections import Counter

import torch

logger = logging.getLogger("lun.data")

# Past this many files of one kind, details go to DEBUG so that a folder of 100k broken files
# does not bury the console; every file is still reported once in a DEBUG log.
WARNINGS_PER_REASON = 20


class BadInputLog:
    """Counts and reports the files of one dataset that were skipped or substituted.

    `source` names the dataset (its folder or shard pattern) in every message.
    """

    def __init__(self, source: str):
        self.source = source
        self.skipped = Counter()  # reason -> files skipped at indexing
        self.warned = Counter()  # reason -> files kept with a warning
        self.failed = None  # (N,) bool shared tensor: item failed to load, set by `track_items`

    def track_items(self, num_items: int) -> None:
        """Allocate the shared per-item flags (call in the main process, before workers start)."""
        self.failed = torch.zeros(num_items, dtype=torch.bool).share_memory_()

    def skip(self, path: str, reason: str, detail: str = "") -> None:
        """A file left out of the index; `reason` is a short category such as "zero bytes"."""
        self._note(self.skipped, "skipped", path, reason, detail)

    def warn(self, path: str, reason: str, detail: str = "") -> None:
        """A file kept despite a problem (e.g. "no caption" when captions default to empty)."""
        self._note(self.warned, "note", path, reason, detail)

    @staticmethod
    def _note(counter: Counter, verb: str, path: str, reason: str, detail: str) -> None:
        counter[reason] += 1
        level = logging.WARNING if counter[reason] <= WARNINGS_PER_REASON else logging.DEBUG
        logger.log(level, "%s %s: %s%s", verb, path, reason, f" ({detail})" if detail else "")

    def load_failed(self, index: int, path: str, error: BaseException) -> bool:
        """An item that failed at load time; logs it the first time only. Returns True if new."""
        if self.failed is None or bool(self.failed[index]):
            return False
        self.failed[index] = True
        logger.warning("unreadable %s (%s), substituted another sample", path, error)
        return True

    def is_known_bad(self, index: int) -> bool:
        return self.failed is not None and bool(self.failed[index])

    def describe(self) -> str:
        """What indexing skipped or warned about: "3 files skipped (2 zero bytes, ...), ..."."""
        skipped = sum(self.skipped.values())
        parts = []
        if skipped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
            parts.append(f"{skipped} files skipped ({reasons})")
        parts += [f"{n} with {reason}" for reason, n in self.warned.most_common()]
        return ", ".join(parts) or "nothing skipped"

    def summarize_index(self, num_items: int) -> str:
        """One line for the end of indexing, also logged."""
        message = f"{self.source}: {num_items} usable items; {self.describe()}"
        logger.info(message)
        return message

    def summarize_epoch(self, when: str) -> str | None:
        """One line at an epoch boundary (`when`: "after epoch 3") if any item failed to load."""
        failed = 0 if self.failed is None else int(self.failed.sum())
        if not failed:
            return None
        message = (
            f"{self.source}: {when}, {failed} of {len(self.failed)} items were unreadable and "
            "replaced by other samples (each is named once above)"
        )
        logger.warning(message)
        return message
