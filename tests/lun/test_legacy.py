"""One compat layer per side: the original configs' spellings are known to ldm/compat.py (model
targets and parameters) and lun/legacy.py (the launchers' keys and options), nowhere else."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Target paths of the original code: CompVis / Stability-AI model classes, their launcher's.
MODEL_SPELLINGS = ("ldm.models.", "ldm.modules.", "sgm.")
LAUNCHER_SPELLINGS = ("main.ImageLogger", "main.DataModuleFromConfig", "resume_from_checkpoint")
# Pickled class names a checkpoint may hold (what the safe loaders accept), not translations.
PICKLED = {"ldm/checkpoint.py", "lun/strategies/checkpoint.py"}


def spelled(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith(prefixes)
    ]


def where(prefixes: tuple[str, ...]) -> set[str]:
    files = [*ROOT.glob("ldm/**/*.py"), *ROOT.glob("lun/**/*.py"), ROOT / "main.py"]
    return {p.relative_to(ROOT).as_posix() for p in files if spelled(p, prefixes)} - PICKLED


def test_the_original_model_targets_are_spelled_in_ldm_compat_only():
    assert where(MODEL_SPELLINGS) == {"ldm/compat.py"}


def test_the_original_launchers_keys_are_spelled_in_the_compat_layers_only():
    assert where(LAUNCHER_SPELLINGS) <= {"lun/legacy.py", "ldm/compat.py"}
    assert "lun/legacy.py" in where(LAUNCHER_SPELLINGS)


def test_main_run_is_three_short_steps():
    """main.run: resolve (the config, the run folder), build (data, trainer, model), train."""
    tree = ast.parse((ROOT / "main.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    calls = [
        n.func.id
        for n in ast.walk(functions["run"])
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
    assert [c for c in calls if c in ("resolve", "build", "train")] == ["resolve", "build", "train"]
    for name in ("run", "resolve", "build", "train"):
        node = functions[name]
        assert node.end_lineno - node.lineno + 1 <= 40, name


def test_compvis_valued_switches_fold_into_ours():
    """CompVis' main.py took `-t True`, `--scale_lr False` (str2bool, an optional value); a
    fine-tune recipe's command line keeps working. Only a true/false word is a value: an
    override after `-t` stays an override."""
    from main import parse_args

    argv = ["--base", "a.yaml", "-t", "True", "--scale_lr", "False", "--no-test", "yes", "x.y=1"]
    opt, dotlist = parse_args(argv + ["-d=0"])
    assert (opt.train, opt.scale_lr, opt.no_test, opt.debug) == (True, False, True, False)
    assert opt.base == ["a.yaml"] and dotlist == ["x.y=1"]
    opt, dotlist = parse_args(["-t", "k.v=2", "--scale_lr", "--no-test=false", "-n", "yes"])
    assert (opt.train, opt.scale_lr, opt.no_test, opt.name) == (True, True, False, "yes")
    assert dotlist == ["k.v=2"]
    assert parse_args(["--train=no", "--scale_lr=1"])[0].train is False
