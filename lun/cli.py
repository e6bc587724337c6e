"""What every script's command line shares: defaults shown in `--help`, one flag style.

Flags are dashed (`--n-samples`); the underscore spellings of the original SD scripts
(`--n_samples`) still parse, as hidden aliases. Nothing heavy is imported here, and scripts
import torch only after their arguments are parsed, so `--help` answers at once.
"""

import argparse
import contextlib
import copy
import math
import pickle
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its example commands), and every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _shows_default(action) and "default" not in text:
            text += (" " if text else "") + "(default: %(default)s)"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):  # argparse skips the help of those
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def _shows_default(action: argparse.Action) -> bool:
    default = action.default  # `is`: 0 and 0.0 are defaults worth showing, False is not
    hidden = default is None or default is False or default is argparse.SUPPRESS
    return bool(action.option_strings) and not hidden and default != []


def old_spelling(parser: argparse.ArgumentParser, old: str, dest: str, **kwargs) -> None:
    """`old` (e.g. `--n_samples`) parses as the documented flag writing `dest`, unlisted in
    --help. Its default is left to the documented flag."""
    parser.add_argument(old, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def positive_int(text: str) -> int:
    """An argparse type for a count or a size (`--steps 0` would sample nothing and write noise,
    `--n-samples 0` fail inside torch): argparse names the flag in its one-line error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def finite_float(text: str) -> float:
    """An argparse type for a number that must be finite (`--scale nan` makes every image NaN)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


SEED_LIMIT = 2**32  # A1111's and numpy's seeds are 32-bit; torch would take up to 2**64 - 1


def seed(text: str) -> int:
    """An argparse type for `--seed`: a whole number in [0, 2**32 - 1]. Without it -1 (A1111's
    "random") silently seeded torch with -1, and 2**64 failed inside torch with "Overflow when
    unpacking long long"; 32 bits keep every seed usable by numpy and in A1111's parameters."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(
            f"expected a whole number in [0, {SEED_LIMIT - 1}], got {text}"
        )
    return value


# --- paths a script writes, checked before anything slow (a model load, a whole evaluation) ---
# One ValueError line naming the flag, which the scripts print with exit status 2; nothing is
# made or written. Only pathlib here, so a script can check before importing torch.


def _file_in_the_way(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists as something other than a folder."""
    for part in (folder, *folder.parents):
        if part.exists():
            return None if part.is_dir() else part
    return None


def check_output_file(path, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """An output file's path: of one of `suffixes` (when given), not a folder, in a folder that
    exists (a mistyped parent is not made silently)."""
    path = Path(path)
    if suffixes and path.suffix not in suffixes:
        raise ValueError(f"{flag} {path}: expected a {' / '.join(suffixes)} file name")
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give the name of the file to write")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: no folder {path.parent}; make it first")


def check_output_folder(path, flag: str) -> None:
    """An output folder's path: not a file, and no file where one of its parents would be (the
    folder and its missing parents are made when written)."""
    path = Path(path)
    blocker = _file_in_the_way(path)
    if blocker == path:
        raise ValueError(f"{flag} {path} is a file; give a folder")
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder")


# --- files a script reads, checked as above -------------------------------------------------


def check_input_file(path, flag: str, give: str = "a weights file", missing: str = "") -> None:
    """A file a flag names: a folder is `FLAG X is a folder; give <give>` (ValueError), a path
    that is not there `FLAG X: no such file<missing>` (FileNotFoundError)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give {give}")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file{missing}")


@contextlib.contextmanager
def naming(flag: str, path):
    """A damaged or refused file's line (`ldm.safe_load`: "X: not a readable ...", "X: refused
    to unpickle ...") says which flag named it: `--vae X: not a readable ...`."""
    try:
        yield
    except (ValueError, pickle.UnpicklingError) as err:
        text = str(err)
        if not text.startswith(str(path)):  # already names its flag, or another file
            raise
        raise type(err)(f"{flag} {text}") from None
