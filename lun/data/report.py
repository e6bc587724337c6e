"""Bad input is skipped, counted and reported once per file - training goes on.

Index-time problems (zero-byte files, malformed JSON, missing fields) are met in the main process.
Load-time problems (an undecodable image, a caption that is not clean UTF-8) are met in DataLoader
workers, so the "already reported" flag of each item lives in a shared-memory tensor: a file is
logged once per run however many workers and epochs meet it, and the main process can count them
for the end-of-epoch summary.
"""

import codecs
import logging
from collections import Counter

import torch

logger = logging.getLogger("lun.data")

# A sample whose image fails is replaced by the next readable one; this many fresh failures in a
# row mean the folder itself is unreadable (a lost mount), and that must stop the run (the
# folder datasets' rule; a WebDataset stream, where failures cluster by shard, has its own).
MAX_FRESH_FAILURES = 64
# The first few files of each reason are kept for the dataset report (lun.data.dataset_report).
EXAMPLES_PER_REASON = 5
# Past this many files of one kind, details go to DEBUG so that a folder of 100k broken files
# does not bury the console; every file is still reported once in a DEBUG log.
WARNINGS_PER_REASON = 20

# What `decode_text` could not read cleanly, as the summaries count it ("3 caption files with
# ..."); at load time item i's flag BadInputLog.noted[i] is 1 + the note's index here.
LEGACY = "not UTF-8 (read as cp1252)"
UNDECODABLE = "undecodable bytes (replaced by U+FFFD)"
LOAD_NOTES = (LEGACY, UNDECODABLE)
# Longest first: the UTF-32 LE mark begins with the UTF-16 LE one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)


def decode_text(raw: bytes) -> tuple[str, str | None]:
    """Text file bytes -> (text, problem): problem is None, LEGACY or UNDECODABLE.

    A byte-order mark names the encoding (UTF-8, UTF-16 or UTF-32, as Windows editors write
    them); UTF-16 without a mark is recognised by its zero bytes (ASCII text has one in every
    other position, which no UTF-8 caption has); otherwise UTF-8, and if that fails cp1252 (the
    Windows superset of latin-1, where older tools' captions come from). Bytes that the chosen
    encoding cannot decode become U+FFFD and the problem says so: never silently.
    """
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            return _decode(raw[len(bom) :], encoding)
    if b"\0" in raw and len(raw) % 2 == 0:
        even, odd = raw[0::2].count(0), raw[1::2].count(0)
        if odd and not even:
            return _decode(raw, "utf-16-le")
        if even and not odd:
            return _decode(raw, "utf-16-be")
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="replace")  # 5 byte values are unassigned in cp1252
        return text, UNDECODABLE if "\ufffd" in text else LEGACY


def _decode(raw: bytes, encoding: str) -> tuple[str, str | None]:
    try:
        return raw.decode(encoding), None
    except UnicodeDecodeError:
        return raw.decode(encoding, errors="replace"), UNDECODABLE


class BadInputLog:
    """Counts and reports the files of one dataset that were skipped or substituted.

    `source` names the dataset (its folder or shard pattern) in every message.
    """

    def __init__(self, source: str):
        self.source = source
        self.skipped = Counter()  # reason -> files skipped at indexing
        self.warned = Counter()  # reason -> files kept with a warning
        self.failed = None  # (N,) bool shared tensor: item failed to load, set by `track_items`
        self.noted = None  # (N,) uint8 shared tensor: 1 + index in LOAD_NOTES of a load-time note
        self.examples = {}  # reason -> the first EXAMPLES_PER_REASON paths (this process's)

    def track_items(self, num_items: int) -> None:
        """Allocate the shared per-item flags (call in the main process, before workers start)."""
        self.failed = torch.zeros(num_items, dtype=torch.bool).share_memory_()
        self.noted = torch.zeros(num_items, dtype=torch.uint8).share_memory_()

    def skip(self, path: str, reason: str, detail: str = "") -> None:
        """A file left out of the index; `reason` is a short category such as "zero bytes"."""
        self._example(reason, path)
        self._note(self.skipped, "skipped", path, reason, detail)

    def warn(self, path: str, reason: str, detail: str = "") -> None:
        """A file kept despite a problem (e.g. "no caption" when captions default to empty)."""
        self._example(reason, path)
        self._note(self.warned, "note", path, reason, detail)

    def _example(self, reason: str, path: str) -> None:
        paths = self.examples.setdefault(reason, [])
        if len(paths) < EXAMPLES_PER_REASON:
            paths.append(path)

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
        self._example("unreadable at load", path)
        logger.warning("unreadable %s (%s), substituted another sample", path, error)
        return True

    def load_note(self, index: int, path: str, note: str) -> bool:
        """An item loaded with a problem (`note`, one of LOAD_NOTES, e.g. a caption that is not
        UTF-8); logs it the first time only. Returns True if new."""
        code = LOAD_NOTES.index(note) + 1
        if self.noted is None or int(self.noted[index]) == code:
            return False
        self.noted[index] = code
        self._example(note, path)
        logger.warning("note %s: %s", path, note)
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
        """One line at an epoch boundary (`when`: "after epoch 3") if any item failed to load or
        was loaded with a note (a caption that is not clean UTF-8)."""
        if self.failed is None:
            return None
        parts = []
        failed = int(self.failed.sum())
        if failed:
            parts.append(
                f"{failed} of {len(self.failed)} items were unreadable and replaced by other samples"
            )
        for code, note in enumerate(LOAD_NOTES, 1):
            count = int((self.noted == code).sum())
            if count:
                parts.append(f"{count} caption file{'s' if count > 1 else ''} with {note}")
        if not parts:
            return None
        message = f"{self.source}: {when}, {'; '.join(parts)} (each is named once above)"
        logger.warning(message)
        return message
