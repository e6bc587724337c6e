"""Building objects from `target:` / `params:` configs - the only reflection in the repo."""

import collections.abc
import difflib
import importlib
import inspect
import logging
import pkgutil
import types
import typing
from collections.abc import Mapping

from ldm.compat import (
    ORIGINAL_TARGETS,
    PARAM_TRANSLATIONS,
    latent_diffusion_params,  # noqa: F401 (its old import path)
)
from ldm.config_errors import ParamError, TargetError

logger = logging.getLogger(__name__)


def _nearest_names(module_path: str, name: str) -> list[str]:
    """Names close to `name` inside `module_path` (or sibling modules when the module is missing)."""
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        parent, _, leaf = module_path.rpartition(".")
        try:
            package = importlib.import_module(parent) if parent else None
        except ImportError:
            return []
        if package is None or not hasattr(package, "__path__"):
            return []
        siblings = [m.name for m in pkgutil.iter_modules(package.__path__)]
        return [f"{parent}.{s}" for s in difflib.get_close_matches(leaf, siblings, n=3)]
    candidates = [n for n in dir(module) if not n.startswith("_")]
    return [f"{module_path}.{n}" for n in difflib.get_close_matches(name, candidates, n=3)]


def get_obj_from_str(path: str):
    """Import `package.module.Name` (original SD paths are mapped through ORIGINAL_TARGETS)."""
    path = ORIGINAL_TARGETS.get(path, path)
    module_path, _, name = path.rpartition(".")
    if not module_path:
        raise TargetError(f"target '{path}' is not a dotted path like 'package.module.Class'")
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as err:
        # Only the module we were asked for is the user's mistake; a missing dependency inside
        # it is not, and must surface as itself.
        if err.name and not module_path.startswith(err.name):
            raise
        near = _nearest_names(module_path, name)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise TargetError(f"target '{path}': no module '{module_path}'{hint}") from None
    if not hasattr(module, name):
        near = _nearest_names(module_path, name)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise TargetError(f"target '{path}': '{module_path}' has no '{name}'{hint}") from None
    return getattr(module, name)


def instantiate_from_config(config: Mapping, **extra_params):
    """Build `target(**params, **extra_params)` from a `{target, params}` mapping.

    The params are checked against the target's signature first: a name it does not take (or a
    required one that is missing) is a `ParamError` naming it, while a TypeError raised inside
    the constructor stays what it is, a bug to report.
    """
    if "target" not in config:
        raise TargetError(f"expected a 'target' key in {dict(config)}")
    target = ORIGINAL_TARGETS.get(config["target"], config["target"])
    params = dict(config.get("params") or {})
    params.update(extra_params)
    translate = PARAM_TRANSLATIONS.get(config["target"]) or PARAM_TRANSLATIONS.get(target)
    if translate is not None:
        params = translate(params)
    obj = get_obj_from_str(target)
    check_params(target, obj, params)
    return obj(**params)


def check_params(target: str, obj, params: dict) -> None:
    """Raise ParamError for a name the target does not take (with the nearest one) or a
    required one that is missing."""
    try:
        signature = inspect.signature(obj)
    except ValueError:  # no signature to check (some builtins)
        return
    accepted = signature.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        for name in params:
            if name not in accepted:
                near = difflib.get_close_matches(name, list(accepted), n=1)
                hint = f"; did you mean '{near[0]}'?" if near else ""
                raise ParamError(f"{target}: unknown parameter '{name}'{hint}")
    try:
        signature.bind(**params)
    except TypeError as err:
        raise ParamError(f"{target}: {err}") from None
    for name, value in params.items():
        if name in accepted and not _fits_annotation(value, accepted[name].annotation):
            kind = NUMBER_KINDS.get(_plain(accepted[name].annotation), "a list")
            raise ParamError(f"{name}={value!r}: expected {kind} ({target})")


# What a parameter annotated with one of these types takes from a config, and how to say it.
NUMBER_KINDS = {int: "a whole number", float: "a number", bool: "true or false"}
SEQUENCES = (collections.abc.Sequence, list, tuple)  # `Sequence[int]`, `list[str]`, ...


def _plain(annotation):
    """int, float or bool for `int`, `float | None`, ... (None for any other annotation)."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(options) == 1:
        annotation = options[0]
    return annotation if annotation in NUMBER_KINDS else None


def _fits_annotation(value, annotation) -> bool:
    """Whether a config value can be what a number or switch annotation says: a string, a
    list or a mapping where the signature wants a number is a config mistake (`depth: abc`)
    that would otherwise be a TypeError inside the constructor. Only that is refused: an int
    for a float, None (many signatures default to it) or an int for a bool pass."""
    if value is not None and typing.get_origin(annotation) in SEQUENCES:
        # `axes_dim: abc`, `dual_attention_layers: 3` (an OmegaConf ListConfig is a Sequence)
        return isinstance(value, collections.abc.Sequence) and not isinstance(value, str | bytes)
    kind = _plain(annotation)
    if kind is None or value is None:
        return True
    if kind is bool:
        return isinstance(value, bool | int)
    return isinstance(value, int | float) and not (
        kind is int and isinstance(value, float) and not value.is_integer()
    )
