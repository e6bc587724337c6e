"""Helpers the end-to-end tests share (imported by name; conftest modules cannot be)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_main(
    args: list[str], cwd: Path, timeout: float = 300, **kwargs
) -> subprocess.CompletedProcess:
    """Run `python main.py ARGS` in a subprocess (how users run it)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def load_main():
    """main.py as a module, to run the launcher in this process and look at what it built."""
    spec = importlib.util.spec_from_file_location("lun_main", ROOT / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
