"""EMA naming (CompVis' LitEma): `model_ema.<name of a parameter of LatentDiffusion.model, dots
removed>` shadows the backbone, beside the scalars `model_ema.decay` / `model_ema.num_updates`."""

from collections.abc import Iterable, Mapping

from ldm.layout.original import backbone_key

EMA_PREFIX = "model_ema."
EMA_SCALARS = (EMA_PREFIX + "decay", EMA_PREFIX + "num_updates")


def ema_key(name: str) -> str:
    """`diffusion_model.input_blocks.0.0.weight` -> `model_ema.diffusion_modelinput_blocks00weight`."""
    return EMA_PREFIX + name.replace(".", "")


def has_ema(state: Mapping) -> bool:
    return any(k.startswith(EMA_PREFIX) and k not in EMA_SCALARS for k in state)


def apply_ema(state: dict, unet_names: Iterable[str]) -> dict:
    """Return a state dict whose `model.*` weights are the EMA shadows (original naming rule)."""
    state = dict(state)
    missing = []
    for name in unet_names:
        shadow = ema_key(name)
        if shadow in state:
            state[backbone_key(name)] = state[shadow]
        else:
            missing.append(shadow)
    if missing:
        raise KeyError(
            f"the checkpoint has EMA weights but lacks {len(missing)} of them, e.g. {missing[0]}"
        )
    return without_ema(state)


def without_ema(state: Mapping) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(EMA_PREFIX)}


def without_shadows(state: Mapping) -> dict:
    """The state dict without the EMA shadows; the EMA scalars (decay, updates) kept."""
    return {k: v for k, v in state.items() if not k.startswith(EMA_PREFIX) or k in EMA_SCALARS}


def drop_ema_shadows(state: dict, prefix: str = "") -> None:
    """In place: remove the `model_ema.*` shadows, which the EMA callback (or `apply_ema`) reads
    from the checkpoint, not the module."""
    for key in [k for k in state if k.startswith(prefix + EMA_PREFIX)]:
        del state[key]
