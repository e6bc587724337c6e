"""The one rule for drawing sampling noise, shared by every sampler (a leaf module: the samplers
of ldm.sampling and ldm.sampling_learned both import it, neither imports the other for it)."""

import torch


def randn_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal noise shaped like x, drawn from `generator` only (never the global RNG).

    Drawn on the generator's device, then moved to x's device: a CPU generator gives the same
    images on every accelerator, a device generator avoids the copy.
    """
    if generator is None:
        raise ValueError(
            "this sampler draws random noise: pass generator=torch.Generator(device).manual_seed(seed)"
        )
    return torch.randn(x.shape, generator=generator, device=generator.device, dtype=x.dtype).to(
        x.device
    )
