"""docs/architecture.md is the map of the code, and the code keeps its rules (issue 31.7):

- every module (ldm/*, ldm/layout/*, lun/*, lun/*/*, scripts/*, main.py) is placed in the doc,
  and every module the doc places exists;
- the layers import downwards only: scripts and main.py -> lun -> ldm (ldm imports neither lun
  nor a script; lun imports no script);
- the data (lun/data) never imports a model: what it takes from ldm is no `torch.nn.Module`;
- no import circle;
- strategies are told apart by class only in lun/strategies/.

The rules are read from the source (ast) and, for "a model", from torch itself
(`issubclass(obj, torch.nn.Module)`), not from a list of our own.
"""

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch
from graph_helpers import circles

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("ldm", "lun", "scripts")
# A module's line in the doc: "- `ldm/unet.py` - what it is".
PLACED = re.compile(r"^- `([\w/]+\.py)`", re.MULTILINE)


def module_files(root: Path = ROOT) -> set[str]:
    found = {"main.py"} if (root / "main.py").exists() else set()
    for package in PACKAGES:
        found |= {p.relative_to(root).as_posix() for p in (root / package).rglob("*.py")}
    return found


def placed(text: str) -> list[str]:
    return PLACED.findall(text)


def unplaced(root: Path, doc: Path) -> tuple[set[str], set[str]]:
    """(modules the doc does not place, placed paths that are no module)."""
    named = set(placed(doc.read_text()))
    files = module_files(root)
    return files - named, named - files


def test_every_module_is_placed_and_every_placed_module_exists():
    missing, gone = unplaced(ROOT, DOC)
    assert not missing, f"docs/architecture.md does not place: {sorted(missing)}"
    assert not gone, f"docs/architecture.md places modules that do not exist: {sorted(gone)}"
    names = placed(DOC.read_text())
    assert len(names) == len(set(names)), "a module is placed twice"


def test_the_placement_check_sees_a_new_and_a_removed_module(tmp_path):
    (tmp_path / "ldm").mkdir()
    (tmp_path / "ldm" / "unet.py").write_text("")
    (tmp_path / "lun").mkdir()
    (tmp_path / "lun" / "new_thing.py").write_text("")
    doc = tmp_path / "architecture.md"
    doc.write_text("- `ldm/unet.py` - the UNet\n- `lun/old_thing.py` - gone\n")
    assert unplaced(tmp_path, doc) == ({"lun/new_thing.py"}, {"lun/old_thing.py"})


# --- imports -------------------------------------------------------------------------------
def module_name(path: str) -> str:
    """`ldm/layout/family.py` -> ldm.layout.family; a script by its file name (`scripts/` is on
    the path of every script: `from benchmark import ...`); main.py -> main."""
    parts = Path(path).with_suffix("").parts
    if parts[0] == "scripts":
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) of every import in a file, at the top or in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = {module_name(f): root / f for f in module_files(root)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in imports_of(path):
            targets |= {module} | {f"{module}.{n}" for n in names}
        graph[name] = (targets & set(modules)) - {name}
    return graph


def layer(module: str) -> str:
    top = module.split(".")[0]
    return top if top in ("ldm", "lun", "main") else "scripts"


def test_the_layers_import_downwards_only():
    """scripts / main.py -> lun -> ldm: ldm imports neither lun nor a script, lun no script."""
    below = {"ldm": {"ldm"}, "lun": {"ldm", "lun"}}
    graph = import_graph()
    wrong = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if layer(name) in below
        for target in sorted(targets)
        if layer(target) not in below[layer(name)]
    ]
    assert not wrong, "scripts -> lun -> ldm:\n" + "\n".join(wrong)


def test_the_data_never_imports_a_model():
    """lun/data builds datasets; what it takes from ldm (config building, tokenizers, a file
    writer) is no torch.nn.Module and no whole module of models."""
    found = []
    for path in sorted((ROOT / "lun" / "data").glob("*.py")):
        for module, names in imports_of(path):
            if module.split(".")[0] != "ldm":
                continue
            if not names:  # `import ldm.unet`: everything in it
                found.append(f"{path.name}: import {module}")
            for name in names:
                obj = getattr(importlib.import_module(module), name)
                if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
                    found.append(f"{path.name}: {module}.{name} is a model")
                elif type(obj).__name__ == "module":
                    found.append(f"{path.name}: from {module} import {name} (a module)")
    assert not found, "lun/data must not know the model:\n" + "\n".join(found)


def test_no_import_circle():
    """Issue 31 counted 5 circles; the last (benchmark.py and its sections) went when the sections'
    shared helpers moved to scripts/bench_common: none may come back."""
    assert circles(import_graph()) == []


def test_the_graph_sees_a_circle_through_a_function_import(tmp_path):
    """A circle closed by an import inside a function (as `from benchmark import main` in a
    section's `__main__` block once did) is a circle too."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "benchmark.py").write_text("from benchmark_dit import dit_section\n")
    (tmp_path / "scripts" / "benchmark_dit.py").write_text(
        "def dit_section():\n    pass\n\n\nif __name__ == '__main__':\n"
        "    from benchmark import main\n"
    )
    assert circles(import_graph(tmp_path)) == [["benchmark", "benchmark_dit"]]


@pytest.mark.parametrize(
    "path, expected",
    [
        ("ldm/layout/family.py", "ldm.layout.family"),
        ("lun/strategies/__init__.py", "lun.strategies"),
    ]
    + [("scripts/gpu_bench/runs.py", "gpu_bench.runs"), ("main.py", "main")],
)
def test_module_names(path, expected):
    assert module_name(path) == expected


# --- strategies ----------------------------------------------------------------------------
def strategy_tests(path: Path, root: Path = ROOT) -> list[str]:
    """`isinstance(<something>strategy, ...)`: a strategy told apart by its class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and node.args
            and re.search(r"(^|\.|_)strategy$", ast.unparse(node.args[0]))
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_strategies_are_told_apart_only_in_lun_strategies():
    """ldm (which cannot import lun) is told what a strategy does as a plain value
    (`strategy_casts_parameters`), lun asks lun.strategies."""
    found = []
    for name in sorted(module_files()):
        if not name.startswith("lun/strategies/"):
            found += strategy_tests(ROOT / name)
    assert not found, "ask lun.strategies (strategy_kind, sharding, ...):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("isinstance(strategy, DDPStrategy)\n", 1),
        ("isinstance(trainer.strategy, ModelParallelStrategy)\n", 1),
        ("isinstance(self._strategy, FSDPStrategy)\n", 1),
        ("isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO)\n", 0),  # a plugin
        ("isinstance(strategy_cfg, str)\n", 0),
    ],
)
def test_the_strategy_scan_reads_each_shape(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert len(strategy_tests(path, tmp_path)) == expected
