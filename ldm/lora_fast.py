"""A leaner training forward for peft's LoRA Linear layers (the common case of `ldm.lora`).

peft's `lora.Linear.forward` computes `result + lora_B(lora_A(dropout(x))) * scaling`: besides
the two small matmuls that is a dropout call (an Identity at dropout 0), a full-size multiply by
the scale and a full-size add, and in the backward another full-size multiply. Written as one
GEMM that accumulates into the base output, `out = base(x) + scaling * (x A^T) B^T` is
`addmm(base(x), x A^T, B^T, alpha=scaling)`: BLAS folds the scale and the sum into the matmul
(C = alpha A B + beta C), and the backward multiplies by the scale only the rank-sized
gradients. Same values, same parameters and state-dict keys: only the layer's class changes to
this subclass, for layers where the short form is exact (one adapter, no dropout, no DoRA, no
LoRA bias); a merged or disabled layer, several adapters or extra arguments take peft's path.
"""

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn


class FastLoraLinear(LoraLinear):
    """peft's `lora.Linear` with `forward` as one accumulating GEMM for its single adapter."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(self.lora_A) != 1:
            return super().forward(x, *args, **kwargs)
        (adapter,) = self.lora_A.keys()
        autocast = torch.is_autocast_enabled(x.device.type)
        lora_A, lora_B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        if (
            args
            or kwargs
            or self.merged
            or self.disable_adapters
            or self.active_adapters != [adapter]
            or not (autocast or x.dtype == lora_A.dtype)  # peft would cast x: its path
        ):
            return super().forward(x, *args, **kwargs)
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        result = self.base_layer(x2)  # (N, out): its own hooks (a base held in bf16) run
        down = F.linear(x2, lora_A)  # (N, r)
        if autocast or result.dtype != lora_B.dtype:
            # autocast picks addmm's dtype; an in-place one would have to keep result's
            result = torch.addmm(result, down, lora_B.t(), alpha=self.scaling[adapter])
        else:
            # in place: the base linear's backward needs its input and weight, not its output
            result = result.addmm_(down, lora_B.t(), alpha=self.scaling[adapter])
        return result.view(*x.shape[:-1], result.shape[-1])


def can_use(layer: nn.Module) -> bool:
    """A peft LoRA layer on a Linear whose update is exactly `scaling * B A x`."""
    if type(layer) is not LoraLinear or len(layer.lora_A) != 1:
        return False
    (adapter,) = layer.lora_A.keys()
    return (
        isinstance(layer.get_base_layer(), nn.Linear)
        and isinstance(layer.lora_dropout[adapter], nn.Identity)
        and not layer.use_dora.get(adapter, False)
        and adapter not in layer.lora_variant
        and not layer.lora_bias.get(adapter, False)
    )


def use_fast_forward(module: nn.Module) -> int:
    """Give every LoRA Linear in `module` where it is exact the fast forward; returns how many."""
    count = 0
    for layer in module.modules():
        if can_use(layer):
            layer.__class__ = FastLoraLinear  # same attributes and state: only forward differs
            count += 1
    return count
