"""Plant bugs one at a time on a scratch copy of the tree and check that the tests catch each.

    python scripts/plant_bugs.py tests/planted/issue32.yaml [--only NAME ...] [--root .]

The list is YAML: one entry per bug, `{name, file, old, new, tests}` - in `file` (relative to the
root) the text `old`, which must occur exactly once, becomes `new`; `tests` are the pytest
arguments that guard it. Each bug runs `pytest -q -x <tests>` on the scratch copy (first on
PYTHONPATH, so it is the code imported) and counts as caught when a test fails (not when the
bug breaks an import). The tree itself is never changed; first the tests run once on the
unchanged copy and must pass. Prints one line per bug and the share caught; exit status 1 when
one was missed, 2 when the list is wrong (an `old` text that is not there exactly once) or the
tests fail without a bug.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SKIPPED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache")


def load(path: Path) -> list[dict]:
    bugs = yaml.safe_load(path.read_text())
    for bug in bugs:
        missing = {"name", "file", "old", "new", "tests"} - set(bug)
        if missing:
            raise ValueError(f"{path}: bug {bug.get('name', '?')!r} lacks {sorted(missing)}")
    return bugs


def plant(scratch: Path, bug: dict) -> str:
    """Apply `bug` in `scratch`; returns the original text to restore."""
    target = scratch / bug["file"]
    text = target.read_text()
    count = text.count(bug["old"])
    if count != 1:
        raise ValueError(f"{bug['name']}: {bug['file']} has the old text {count} times, not once")
    target.write_text(text.replace(bug["old"], bug["new"]))
    return text


def _args(tests: list[str] | str) -> list[str]:
    return tests.split() if isinstance(tests, str) else list(tests)


def pytest_status(scratch: Path, tests: list[str] | str) -> int:
    """pytest's exit status on `tests` (its arguments) in `scratch`: 0 all passed, 1 a test
    failed, 2 or more a collection error (a bug that breaks an import shows no teeth)."""
    env = {**os.environ, "PYTHONPATH": str(scratch)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *_args(tests)],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
    )
    return result.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bugs", type=Path, help="the YAML list of bugs")
    parser.add_argument("--root", type=Path, default=Path("."), help="the tree (default: .)")
    parser.add_argument("--only", nargs="*", help="names of the bugs to plant (default: all)")
    opt = parser.parse_args(argv)
    try:
        bugs = [b for b in load(opt.bugs) if not opt.only or b["name"] in opt.only]
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"plant_bugs: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="planted-") as folder:
        scratch = Path(folder) / "tree"
        shutil.copytree(opt.root, scratch, ignore=SKIPPED)
        for bug in bugs:  # every bug can be planted, before the long run
            text = (scratch / bug["file"]).read_text()
            if text.count(bug["old"]) != 1:
                print(f"plant_bugs: {bug['name']}: the old text is not in {bug['file']} once")
                return 2
        files = sorted({_args(b["tests"])[0] for b in bugs})
        if pytest_status(scratch, files) != 0:  # the tests must pass on the tree as it is
            print(f"plant_bugs: the tests fail without a bug planted: {' '.join(files)}")
            return 2
        results = []
        for bug in bugs:
            try:
                original = plant(scratch, bug)
            except ValueError as err:
                print(f"plant_bugs: {err}", file=sys.stderr)
                return 2
            try:
                results.append(pytest_status(scratch, bug["tests"]) == 1)
            finally:
                (scratch / bug["file"]).write_text(original)
            verdict = "caught" if results[-1] else "MISSED"
            print(f"{verdict:7} {bug['name']}  ({bug['file']})", flush=True)
    print(f"{sum(results)} of {len(results)} caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
