"""Building objects from `target:` / `params:` configs - the only reflection in the repo."""

import difflib
import importlib
import pkgutil
from collections.abc import Mapping

# The original CompVis / Stability-AI configs name their classes by the original module paths.
# They load unchanged: each original path maps to the class that replaces it here.
ORIGINAL_TARGETS = {
    "ldm.models.diffusion.ddpm.LatentDiffusion": "ldm.diffusion.LatentDiffusion",
    "ldm.modules.diffusionmodules.openaimodel.UNetModel": "ldm.unet.UNetModel",
    "ldm.models.autoencoder.AutoencoderKL": "ldm.autoencoder.AutoencoderKL",
    "ldm.models.autoencoder.IdentityFirstStage": "ldm.autoencoder.IdentityFirstStage",
    "ldm.modules.encoders.modules.FrozenCLIPEmbedder": "ldm.text_encoder.FrozenCLIPEmbedder",
    "ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
    "ldm.lr_scheduler.LambdaLinearScheduler": "ldm.optim.LambdaLinearScheduler",
}


class TargetError(ValueError):
    """A `target:` that does not name an importable object; the message says what is near."""


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
    """Build `target(**params, **extra_params)` from a `{target, params}` mapping."""
    if "target" not in config:
        raise TargetError(f"expected a 'target' key in {dict(config)}")
    params = dict(config.get("params") or {})
    params.update(extra_params)
    return get_obj_from_str(config["target"])(**params)
