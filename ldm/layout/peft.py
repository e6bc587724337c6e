"""LoRA (peft) run checkpoints: a wrapped layer's weights keep their original names (peft's
`base_layer.` level removed) and its adapter weights go apart, under `lora.` + the layer's
original name + `lora_A.weight` / `lora_B.weight` / `lora_magnitude_vector.weight` (peft's
adapter-name level removed), so a LoRA run's checkpoint is still an original one with extra keys.
Renamed by the model's checkpoint hooks (`ldm.lora`), not by state-dict hooks.
"""

import re
from collections.abc import Iterable, Mapping

from ldm.layout.ema import ema_key

LORA_PREFIX = "lora."
PEFT_BASE_LEVEL = "base_layer."
PEFT_ADAPTER_LEVEL = re.compile(r"\.(lora_A|lora_B|lora_magnitude_vector)\.[^.]+\.")


def peft_free_name(name: str) -> str:
    """A name without peft's levels: `...to_q.base_layer.weight` -> `...to_q.weight`,
    `...to_q.lora_A.default.weight` -> `...to_q.lora_A.weight`."""
    return PEFT_ADAPTER_LEVEL.sub(r".\1.", without_base_level(name))


def without_base_level(name: str) -> str:
    """`...to_q.base_layer.weight` -> `...to_q.weight` (a wrapped layer's own weights)."""
    return name.replace("." + PEFT_BASE_LEVEL, ".")


def is_adapter_name(name: str) -> bool:
    return PEFT_ADAPTER_LEVEL.search(name) is not None


def has_adapters(state: Mapping) -> bool:
    """A LoRA run's checkpoint (its adapters under `lora.`), not a base model's."""
    return any(k.startswith(LORA_PREFIX) for k in state)


def original_key(name: str) -> str:
    """The checkpoint key of a LoRA model's state-dict entry: base weights under their original
    names, adapter weights apart under `lora.`."""
    return (LORA_PREFIX if is_adapter_name(name) else "") + peft_free_name(name)


def to_original_layout(state: Mapping, backbone_names: Iterable[str] = ()) -> dict:
    """A LoRA model's state dict (peft's names) -> checkpoint keys (`original_key`); the EMA
    shadows of `backbone_names` (names in `LatentDiffusion.model`) lose peft's levels too."""
    renamed = {ema_key(n): ema_key(peft_free_name(n)) for n in backbone_names}
    return {renamed.get(k) or original_key(k): v for k, v in state.items()}


def to_module_layout(
    state: dict, module_keys: Iterable[str], backbone_names: Iterable[str] = ()
) -> None:
    """In place: checkpoint keys -> the module's (peft's) names, the inverse of
    `to_original_layout`. Keys already in the module's form are kept; adapter keys are
    also accepted without the `lora.` level (as `apply_ema` writes them)."""
    names = {}
    for key in module_keys:
        names[original_key(key)] = names[peft_free_name(key)] = key
    names.update({ema_key(peft_free_name(n)): ema_key(n) for n in backbone_names})
    for key in [k for k in state if k in names and names[k] != k]:
        state[names[key]] = state.pop(key)


def ema_shadowed(named_parameters: Iterable, state: Mapping) -> list[str]:
    """The backbone's names (`LatentDiffusion.model.named_parameters()`) whose EMA shadows
    `state` holds. EMA shadows exist for trained weights only (LitEma's rule: not DiT's fixed
    pos_embed); under LoRA layers, a LoRA run's file shadows its adapters only and a base
    model's file its base weights, by their checkpoint names."""
    named = list(named_parameters)
    if not any(PEFT_BASE_LEVEL in n for n, _ in named):
        return [n for n, p in named if p.requires_grad]
    in_file = has_adapters(state)
    return [peft_free_name(n) for n, _ in named if is_adapter_name(n) == in_file]


def missing_after_load(missing: Iterable[str], state: Mapping) -> list[str]:
    """The keys a strict load of `state` really misses: fresh adapters are not missing from a
    base model's file (an original file, a full fine-tune) that has none."""
    return list(missing) if has_adapters(state) else [k for k in missing if not is_adapter_name(k)]
