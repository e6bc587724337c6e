"""What the DeepSpeed and FSDP adapters and the checkpoint reader share: the `Sharding` report
(what the memory plan asks a strategy), where callback state rides in an engine's checkpoint,
which parts are frozen, and the one-line error for a missing engine package."""

import importlib.util
from dataclasses import dataclass

import torch

# What a callback stores in a checkpoint's state dict besides the module's own entries; kept
# under this key in DeepSpeed's client state (its engine saves the module weights itself).
CALLBACK_STATE_KEY = "lun_callback_state_dict"


@dataclass(frozen=True)
class Sharding:
    """How a strategy divides each rank's training state (what the memory plan asks for).

    weights / gradients / optimizer: how many ranks share that part (1: a full copy on every
    rank; a rank holds 1/n of it). The ZeRO paper's three stages are exactly these three
    switches (Rajbhandari et al. 2020, sec. 5 and fig. 1).
    """

    weights: int = 1
    gradients: int = 1
    optimizer: int = 1
    optimizer_on_host: bool = False
    weights_on_host: bool = False
    buckets: int = 0  # DeepSpeed's gradient reduction buffers, values
    full_state_dict_gather: bool = False  # FSDP writes a full checkpoint gathered on rank 0
    half_weights_with_master: bool = (
        False  # DeepSpeed mixed precision: 16-bit weights + fp32 master
    )
    name: str = "single device"

    @property
    def gathers_weights_per_block(self) -> bool:
        """Sharded weights are all-gathered unit by unit for its forward and backward."""
        return self.weights > 1


def require(package: str, why: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{why} needs the package '{package}': pip install {package}")


def callback_entries(state: dict, module: torch.nn.Module) -> dict:
    """Entries of a checkpoint's state dict that are not the module's own: callbacks put them
    there (the EMA's `model_ema.*`). Told apart by their first name level."""
    own = {name for name, _ in module.named_children()}
    own |= {name for name, _ in module.named_parameters(recurse=False)}
    own |= {name for name, _ in module.named_buffers(recurse=False)}
    return {k: v for k, v in state.items() if k.split(".", 1)[0] not in own}


def frozen_children(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Direct submodules that have parameters, none of them trainable."""
    found = []
    for child in model.children():
        params = list(child.parameters())
        if params and not any(p.requires_grad for p in params):
            found.append(child)
    return found
