"""Re-resolve every dependency to its newest release and keep the result only if the suite passes.

    make lock                      # = python scripts/lock.py --torch "torch==2.13.0"
    python scripts/lock.py --torch "torch==2.13.0" --venv .venv-lock --keep-venv
    python scripts/lock.py --hold transformers==5.23.0   # every other package moves

Steps: a fresh venv (`--venv`), torch first (`--torch`, as `make setup` does), then the
requirements files with no constraints (so pip takes the newest releases their ranges allow),
then `pip freeze` into a candidate lock and the lint + the whole test suite in that venv. Green:
the candidate replaces requirements-lock.txt and the packages that moved are listed. Red: the lock
is left as it was, the candidate is kept as requirements-lock.next.txt, and the packages that
moved are printed, since one of them broke the suite.

`--hold NAME==VERSION` keeps a package where it is while the rest move: for a release known to
break the suite upstream (say a transformers that needs a peft not yet on PyPI), so that one bad
release does not also hold back every other package. The held pins are passed to pip as
constraints and end up in the lock like any other pin.
"""

import argparse
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"
NEXT = ROOT / "requirements-lock.next.txt"
REQUIREMENTS = ["requirements.txt", "requirements-dev.txt"]
NO_DEPS = ["requirements-vocab.txt", "requirements-lpips.txt"]  # their deps pull torchvision
# torch is pinned by the Makefile (TORCH_VERSION) and installed on its own, for the CPU or CUDA.
NOT_LOCKED = {"torch", "lun-diffusion"}


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a lock or freeze file, by normalised name (PEP 503)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package whose version changed, appeared or went away."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before != after:
            lines.append(f"{name}: {before or '-'} -> {after or '-'}")
    return lines


def lock_text(freeze: str) -> str:
    header = [line for line in LOCK.read_text().splitlines() if line.startswith("#")]
    body = sorted(
        (line for line in freeze.splitlines() if "==" in line and not line.startswith("-e")),
        key=str.lower,
    )
    body = [line for line in body if normalise(line.split("==")[0]) not in NOT_LOCKED]
    return "\n".join(header + body) + "\n"


def not_held(hold: list[str], pins: dict[str, str]) -> list[str]:
    """The `--hold` specs the resolved pins do not show: a misspelt name constrains nothing."""
    missing = []
    for spec in hold:
        name, version = spec.split("==", 1)
        if pins.get(normalise(name)) != version.strip():
            missing.append(spec)
    return missing


def install_steps(py: str, torch_spec: str, held: Path | None = None) -> list[list[str]]:
    """The pip commands of a fresh environment, as `make setup` runs them but with no lock: torch
    on its own, then the requirements at their newest (only the `held` constraints file, if any,
    keeps packages back), then the no-deps files and the project."""
    pip = [py, "-m", "pip", "install", "-q"]
    constraints = ["-c", str(held)] if held else []
    return [
        pip + ["--upgrade", "pip", "setuptools"],
        pip + [torch_spec],
        pip + constraints + sum((["-r", f] for f in REQUIREMENTS), []),
        pip + ["--no-deps"] + sum((["-r", f] for f in NO_DEPS), []),
        pip + ["--no-deps", "--no-build-isolation", "-e", "."],
    ]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kwargs)


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from lun.cli import HelpFormatter  # every option's default in --help

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--torch", default="torch==2.13.0", help="pip spec for torch")
    parser.add_argument("--venv", default=".venv-lock", help="where the fresh venv goes")
    parser.add_argument("--keep-venv", action="store_true", help="do not delete it afterwards")
    parser.add_argument(
        "--no-tests", action="store_true", help="resolve and write the candidate only"
    )
    parser.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="keep this package at this version (repeatable)",
    )
    args = parser.parse_args(argv)
    bad = [spec for spec in args.hold if "==" not in spec]
    if bad:
        parser.error(f"--hold {bad[0]}: give an exact pin, NAME==VERSION")

    env_dir = ROOT / args.venv
    shutil.rmtree(env_dir, ignore_errors=True)
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    held = None
    if args.hold:
        held = env_dir / "held.txt"
        held.write_text("\n".join(args.hold) + "\n")
    steps = install_steps(py, args.torch, held)
    for step in steps:
        if run(step).returncode:
            print("lock: installing failed (above); requirements-lock.txt unchanged")
            return 1
    freeze = run([py, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    NEXT.write_text(lock_text(freeze))
    changes = moved(read_pins(LOCK), read_pins(NEXT))
    print("packages that moved:" if changes else "no package moved")
    for line in changes:
        print("  " + line)
    unheld = not_held(args.hold, read_pins(NEXT))
    if unheld:
        print(f"lock: --hold {unheld[0]}: no such pin in the candidate (is the name right?)")
        return 2
    for spec in args.hold:
        print(f"  held: {spec}")
    if args.no_tests:
        print(f"lock: candidate written to {NEXT.name} (not tested)")
        return 0
    checks = [
        [py, "-m", "ruff", "check", "."],
        [py, "-m", "ruff", "format", "--check", "."],
        [py, "-m", "pytest", "-q"],
    ]
    # tests/project/test_lock.py checks the installed versions against the candidate, not the old lock
    env = {**os.environ, "LUN_LOCK_FILE": str(NEXT)}
    green = all(run(check, env=env).returncode == 0 for check in checks)
    if not args.keep_venv:
        shutil.rmtree(env_dir, ignore_errors=True)
    if green:
        NEXT.replace(LOCK)
        print("lock: the suite passed; requirements-lock.txt rewritten")
        return 0
    print(
        f"lock: the suite FAILED with the newest releases; kept the old lock, candidate in {NEXT.name}"
    )
    print("  one of the packages that moved (listed above) broke it")
    return 1


if __name__ == "__main__":
    sys.exit(main())
