"""Family and mode branches stay in the files that own them (issue 31, "Modes as objects").

A new family or training mode is new files behind the seams (`ldm.adapters` for modes, the
backbone / conditioner / layout files for families, the batch contract for what the data hands
the step), not `if`s in shared code. This test reads every production file's syntax tree and
counts the branches (`if`, conditional expressions, comprehension filters, `while`) whose test
names a family or a mode - LoRA / DoRA / adapters, DiT, SDXL, SD 2 / SD 3, Flux, MMDiT,
learn_sigma, DreamBooth, a cached latent or loss weight key of the batch - or probes a
conditioner or encoder with `hasattr` / `getattr`, outside the file that owns that rule.

Measured on main at bb48a68 (the issue): 29 such branches, 12 of them in ldm/diffusion.py.
Goal: <= 3 in ldm's shared files. lun's shared files have owners of their own (the house and
loop helpers): their count is a ceiling here so that none are added, to be lowered as they go.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAMILY_OR_MODE = re.compile(
    r"(^|_)(lora|dora|adapters?|dit|sdxl|sd[123]|flux|mmdit|learn_sigma|dreambooth)(_|$|\d)",
    re.IGNORECASE,
)
BATCH_MODE_KEYS = {"latent", "loss_weight"}  # the batch contract's (ldm.model_contract)
FAMILY_KEYS = {"embedders", "conditioner_config"}  # SDXL told from a config or a module
PROBED = re.compile(r"conditioner|encoder|embedder|cond_stage|tower", re.IGNORECASE)
# An encoder's insides, whatever the variable holding it is called.
PROBED_ATTRIBUTES = {"embedders", "transformer", "text_model", "tokenizer", "tokenize", "LAYERS"}

# Files that own a family or a mode: their branches on it are the rule, not a leak.
MODE_OWNERS = (
    "ldm/adapters.py",  # training modes
    "ldm/lora/",
    "ldm/lora_fast.py",
    "ldm/quantize.py",  # LoRA's quantized frozen base
    "ldm/block_swap.py",
    "ldm/model_contract.py",  # the batch contract: cached latents, loss weights
    "ldm/layout/",  # families by their keys
    "ldm/unet.py",  # each backbone, objective and conditioner is its family's
    "ldm/dit.py",
    "ldm/dit_text.py",
    "ldm/mmdit.py",
    "ldm/flux.py",
    "ldm/flow.py",
    "ldm/objectives.py",
    "ldm/vlb.py",
    "ldm/sampling_learned.py",
    "ldm/conditioning",
    "ldm/text_encoder",
    "ldm/compat.py",  # the one compat layer: old configs' family defaults
    "ldm/compat_api.py",
    "lun/legacy.py",
    "lun/lora_use.py",  # LoRA files at generation
    "lun/memory_quant.py",  # LoRA's base_quantization in the memory plan
    "lun/prior_images.py",  # DreamBooth's class images
    "lun/data/dreambooth.py",
    "lun/data/latent_cache",
    "lun/data/dataset_report_sd3.py",
)
PROBE_OWNERS = ("ldm/conditioning", "ldm/text_encoder")  # an encoder may look at itself

LDM_GOAL = 3
# lun's shared files at this commit: lun/generation.py 1 (a model file that is a VAE or a LoRA
# file, when no family is expected). The --lora file checks went to lun/lora_use.py, and a
# sharded checkpoint's names lose peft's levels whatever the run. A ceiling: lower it, never raise it.
LUN_CEILING = 1


def _names(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr


def _is_probe(node: ast.AST) -> bool:
    """`hasattr(conditioner, ...)`, `getattr(encoder, ...)`, `hasattr(m, "tokenizer")`: a
    module's kind told by its insides."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
        and len(node.args) >= 2
    ):
        return False
    attribute = node.args[1]
    return any(PROBED.search(name) for name in _names(node.args[0])) or (
        isinstance(attribute, ast.Constant) and attribute.value in PROBED_ATTRIBUTES
    )


def branch_kinds(test: ast.AST) -> set[str]:
    """What a branch's test looks at: "probe" (an encoder's insides), "mode" (a family or mode
    by name, or a mode's batch key); empty for anything else."""
    kinds = set()
    for node in ast.walk(test):
        if _is_probe(node):
            kinds.add("probe")
        elif isinstance(node, ast.Constant) and node.value in BATCH_MODE_KEYS | FAMILY_KEYS:
            kinds.add("mode")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a name spelled as a string: getattr(model, "lora_settings", None), "sdxl" in name
            words = re.split(r"\W+", node.value)
            if any(FAMILY_OR_MODE.search(word) for word in words):
                kinds.add("mode")
    if any(FAMILY_OR_MODE.search(name) for name in _names(test)):
        kinds.add("mode")
    return kinds


def branches(source: str):
    """(line, kinds) of each branch of `source` that tests a family or a mode."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        else:
            continue
        for test in tests:
            kinds = branch_kinds(test)
            if kinds:
                yield test.lineno, kinds


def leaks(path: str, source: str) -> list[str]:
    """The branches of the file at `path` (relative to the repo) that test a family or a mode
    it does not own."""
    owned = set()
    if path.startswith(MODE_OWNERS):
        owned.add("mode")
    if path.startswith(PROBE_OWNERS):
        owned.add("probe")
    return [
        f"{path}:{line} ({', '.join(sorted(kinds - owned))})"
        for line, kinds in branches(source)
        if kinds - owned
    ]


def leaks_under(package: str) -> list[str]:
    found = []
    for file in sorted((ROOT / package).rglob("*.py")):
        path = file.relative_to(ROOT).as_posix()
        found += leaks(path, file.read_text())
    return found


def test_ldm_has_at_most_three_family_or_mode_branches_outside_their_owners():
    found = leaks_under("ldm")
    print(f"ldm: {len(found)} family/mode branches outside their owners", *found, sep="\n  ")
    assert len(found) <= LDM_GOAL, "\n".join(found)


def test_lun_gains_no_family_or_mode_branches():
    found = leaks_under("lun")
    print(f"lun: {len(found)} family/mode branches outside their owners", *found, sep="\n  ")
    assert len(found) <= LUN_CEILING, "\n".join(found)


def test_latent_diffusion_asks_no_family_or_mode():
    """The module every family and mode shares calls hooks and the contract, never asks."""
    path = "ldm/diffusion.py"
    assert leaks(path, (ROOT / path).read_text()) == []


# --- the scanner itself, on planted branches (each must be seen; plain code must not) ---------
PLANTED = {
    "if self.lora_settings is not None:\n    pass": {"mode"},
    "x = 1 if is_sdxl(model) else 2": {"mode"},
    "if hasattr(model.conditioner, 'embedders'):\n    pass": {"mode", "probe"},
    "if getattr(encoder, 'layer', None) == 'hidden':\n    pass": {"probe"},
    "towers = [m for m in model.modules() if hasattr(m, 'tokenize')]": {"probe"},
    "if 'latent' in batch:\n    pass": {"mode"},
    "w = batch['loss_weight'] if 'loss_weight' in batch else 1": {"mode"},
    "if isinstance(backbone, MMDiT):\n    pass": {"mode"},
    "if self.backbone.learn_sigma:\n    pass": {"mode"},
    "if getattr(model, 'lora_settings', None):\n    pass": {"mode"},
    "if 'model.params.dreambooth' in keys:\n    pass": {"mode"},
    "names = [n for n in names if not peft.is_adapter_name(n)]": {"mode"},
    "if family.model_family(model) == family.SD2:\n    pass": {"mode"},
}


def test_the_scanner_sees_each_kind_of_planted_branch():
    for source, kinds in PLANTED.items():
        assert [k for _, k in branches(source)] == [kinds], source


def test_the_scanner_passes_plain_code_and_owners():
    plain = (
        "if stage == 'fit':\n    pass\nif x.shape[1] == 2 * c:\n    pass\nif unet_names:\n    pass"
    )
    assert list(branches(plain)) == []
    lora_branch = "if settings.dora:\n    pass"
    assert leaks("ldm/lora/inject.py", lora_branch) == []
    assert leaks("ldm/diffusion.py", lora_branch) == ["ldm/diffusion.py:1 (mode)"]
    probe = "if hasattr(self.conditioner, 'embedders'):\n    pass"
    assert leaks("ldm/lora/targets.py", probe) == ["ldm/lora/targets.py:1 (probe)"]
    assert leaks("ldm/conditioning_xl.py", probe) == []
