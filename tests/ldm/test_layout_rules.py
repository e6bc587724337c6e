"""The rules of the weights layout (issue 31.3), pinned so a new family cannot undo them:

- key prefixes (where a part sits in a checkpoint, the levels wrappers add, other tools' names)
  are spelled only under `ldm/layout/`;
- the modules of `ldm` import each other without a circle (`ldm.safe_load` -> `ldm.layout` ->
  `ldm.checkpoint`, never back);
- `ldm` never imports `lun` (scripts -> lun -> ldm).

The prefixes are not taken from our code: they are read from the reference key lists of the
released checkpoints (tests/reference) and the wrapper levels are the tools' own attribute names.
"""

import ast
import json
import re
from pathlib import Path

import pytest
from graph_helpers import circles

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"
PRODUCTION = ("ldm", "lun", "scripts", "main.py")
LAYOUT = "ldm/layout/"

# The levels wrappers add to parameter names, by the attribute each wrapper stores the module in.
WRAPPER_LEVELS = (
    "_orig_mod.",  # torch.compile: torch._dynamo.eval_frame.OptimizedModule._orig_mod
    "module.",  # torch.nn.parallel.DistributedDataParallel.module
    "_forward_module.",  # Lightning's _LightningModuleWrapperBase (DeepSpeed, FSDP)
    "_fsdp_wrapped_module.",  # torch.distributed.fsdp FullyShardedDataParallel
    "_checkpoint_wrapped_module.",  # torch.distributed.algorithms checkpoint_wrapper
    "base_model.model.",  # peft.PeftModel.base_model (a LoraModel) .model
    "base_layer.",  # peft's tuner layers (LoraLayer.base_layer)
)
# Names of the next families' single files (owners' agreement for SD 3.5 and Flux.1), and the
# level transformers' CLIPTextModel had before 5.6.
OTHER_LEVELS = ("text_encoders.", "double_blocks.", "single_blocks.", "text_model.")
# Our LoRA runs' adapters sit apart under this level (ldm/layout/peft.py's rule, docs/lora.md).
ADAPTER_LEVEL = "lora."
KOHYA_NAME = re.compile(r"lora_(unet|te\d?)_")  # kohya-ss: lora_unet_*, lora_te_*, lora_te1/2_*


def reference_parts() -> set[str]:
    """Where the parts of a released checkpoint sit: the first level of its keys (the backbone's
    two: `model.` alone is also the config's root, `model.params...`), the EMA shadows', and
    DiT's embedders (its released files hold the backbone bare)."""
    parts = set()
    for name in ("sd_v1_keys.json", "sd_v2_base_keys.json", "sdxl_base_keys.json"):
        data = json.loads((REFERENCE / name).read_text())
        keys = [*data["keys"], *(data.get("extra_keys_in_released_checkpoints") or {})]
        for key in keys:
            first, _, rest = key.partition(".")
            if not rest:
                continue  # a schedule buffer at the root
            if first == "model":  # and the backbone's name inside it, which EMA names use
                parts |= {f"{first}.{rest.split('.')[0]}.", f"{rest.split('.')[0]}."}
            else:
                parts.add(f"{first}.")
    dit = json.loads((REFERENCE / "dit_xl2_256_keys.json").read_text())["keys"]
    parts |= {k.split(".")[0] + "." for k in dit if k.split(".")[0].endswith("_embedder")}
    return parts


def key_prefixes() -> tuple[str, ...]:
    return tuple(sorted(reference_parts() | {*WRAPPER_LEVELS, *OTHER_LEVELS, ADAPTER_LEVEL}))


def test_the_reference_parts_are_the_known_ones():
    """Guards the derivation above: it must find the parts of every family's files."""
    expected = {"model.diffusion_model.", "diffusion_model.", "first_stage_model."}
    expected |= {"cond_stage_model."}
    expected |= {"conditioner.", "model_ema.", "x_embedder.", "t_embedder.", "y_embedder."}
    assert reference_parts() == expected


def production_files(root: Path = ROOT) -> list[Path]:
    files = [root / "main.py"]
    for folder in PRODUCTION[:-1]:
        files += sorted((root / folder).rglob("*.py"))
    return files


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def prefix_literals(path: Path, prefixes: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """The string constants of a file (f-string parts too; not docstrings, not sentences: a
    message may name a prefix for the user) that spell a key prefix."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        text = node.value
        if id(node) in docs or not text or any(c.isspace() for c in text):
            continue
        if text.startswith(prefixes) or text == "model." or KOHYA_NAME.match(text):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_no_key_prefix_is_spelled_outside_ldm_layout():
    prefixes = key_prefixes()
    found = []
    for path in production_files():
        if not path.relative_to(ROOT).as_posix().startswith(LAYOUT):
            found += prefix_literals(path, prefixes)
    assert not found, "key prefixes belong in ldm/layout/ (ask it for names):\n" + "\n".join(found)


def test_the_layout_package_does_spell_them():
    """The scan sees prefixes where they are (a scan that finds nothing proves nothing)."""
    prefixes = key_prefixes()
    found = [x for p in sorted((ROOT / LAYOUT).glob("*.py")) for x in prefix_literals(p, prefixes)]
    spelled = " ".join(found)
    for expected in ("'model_ema.'", "'first_stage_model.'", "'_orig_mod.'", "'lora_unet_'"):
        assert expected in spelled


# --- imports -------------------------------------------------------------------------------
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, at the top or inside a function (a lazy import is still a
    dependency); `from ldm import checkpoint` names the module `ldm.checkpoint`."""
    found = set()
    package = module_name(path, root).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1]])
                base = f"{base}.{node.module}" if node.module else base
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph(package: str = "ldm", root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    return {name: imports_of(path, root) & set(files) - {name} for name, path in files.items()}


def test_circles_finds_a_loop_and_only_loops():
    """The detector itself, on hand-drawn graphs."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_ldm():
    graph = import_graph()
    assert "ldm.layout.family" in graph["ldm.checkpoint"]  # the graph sees `from ldm.layout import`
    found = circles(graph)
    assert not found, f"import circles in ldm: {found}"


def test_ldm_never_imports_lun():
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "ldm").rglob("*.py"))
        for name in imports_of(path)
        if name == "lun" or name.startswith("lun.")
    ]
    assert not found, "ldm must not depend on lun (scripts -> lun -> ldm):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("x = 'model_ema.' + name\n", ["model_ema."]),
        ("x = f'model.diffusion_model.{name}'\n", ["model.diffusion_model."]),
        ("x = 'lora_te1_' + name\n", ["lora_te1_"]),
        ("x = name.replace('_orig_mod.', '')\n", ["_orig_mod."]),
        ("x = 'model.params.ckpt_path'\n", []),  # a config path, not a key
        ("x = 'no such key first_stage_model.x'\n", []),  # a sentence for the user
    ],
)
def test_the_scan_reads_constants_and_f_strings(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = prefix_literals(path, key_prefixes(), tmp_path)
    assert [f.split(": ", 1)[1].strip("'") for f in found] == expected


# --- one SDXL test -------------------------------------------------------------------------
# `ldm.layout.family.is_sdxl` is the one place that tells SDXL (issue 31): a model by its keys,
# a config by its conditioner, a diffusers UNet config by `addition_embed_type`. The other ways
# it used to be told, each a shape the scan below finds anywhere else:
SDXL_OWNER = "ldm/layout/family.py"
# The LoRA code's own `is_sdxl` (hasattr(conditioner, "embedders")), which the adapters work of
# issue 31.2 replaces by a call to family.is_sdxl: remove the entry when it has gone.
SDXL_PENDING = set()
SDXL_VECTOR_WIDTH = 1280 + 3 * 2 * 256  # SDXL base's `vector`: pooled bigG + 3 size pairs


def sdxl_tests(path: Path, root: Path = ROOT) -> list[str]:
    """Where a file tells SDXL itself: `hasattr(_, "embedders")` (sgm's conditioner), a
    comparison with 2816 (the vector width) or with `text_time` (diffusers' addition_embed_type),
    or a function of its own named `*is_sdxl`. Asserts are checks, not branches: not counted."""
    tree = ast.parse(path.read_text())
    asserted = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith(
            "is_sdxl"
        ):
            what = f"def {node.name}"
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "hasattr"
            and len(node.args) == 2
            and getattr(node.args[1], "value", None) == "embedders"
        ):
            what = 'hasattr(..., "embedders")'
        elif isinstance(node, ast.Compare) and id(node) not in asserted:
            values = {getattr(n, "value", None) for n in [node.left, *node.comparators]}
            if SDXL_VECTOR_WIDTH in values or "text_time" in values:
                what = f"compares with {(values & {SDXL_VECTOR_WIDTH, 'text_time'}).pop()!r}"
        if what:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {what}")
    return found


def test_sdxl_is_told_only_by_ldm_layout_family():
    found, pending = [], set()
    for path in production_files():
        name = path.relative_to(ROOT).as_posix()
        hits = sdxl_tests(path)
        if name in SDXL_PENDING:
            pending |= {name} if hits else set()
        elif name != SDXL_OWNER:
            found += hits
    assert not found, "ask ldm.layout.family.is_sdxl instead:\n" + "\n".join(found)
    assert pending == SDXL_PENDING, f"no SDXL test left in {SDXL_PENDING - pending}: unlist it"


def test_the_owner_does_tell_sdxl():
    assert sdxl_tests(ROOT / SDXL_OWNER)  # a scan that finds nothing proves nothing


@pytest.mark.parametrize(
    "source, expected",
    [
        ("x = hasattr(model.conditioner, 'embedders')\n", 1),
        ("x = params.get('adm_in_channels') == 2816\n", 1),
        ("if unet.get('addition_embed_type') == 'text_time':\n    pass\n", 1),
        ("def _is_sdxl(config):\n    return True\n", 1),
        ("assert config['addition_embed_type'] == 'text_time'\n", 0),  # a check of a result
        ("x = hasattr(model, 'conditioner')\n", 0),
        ("x = width == 2048\n", 0),
    ],
)
def test_the_sdxl_scan_reads_each_shape(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert len(sdxl_tests(path, tmp_path)) == expected
