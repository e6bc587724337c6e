"""The process's random-number streams: their state as tensors (so a checkpoint can carry them),
and blocks run under streams chosen by a key (so data loading never moves them).

Training draws from the global generators: torch's CPU generator (caption dropout), the
accelerator's (timesteps, noise), and `random` / numpy for anything else. An exact resume puts
all of them back where they were (`capture` / `restore`, saved by
`lun.callbacks.rng_state.RNGState`). Data loading draws too (flips, crops, tag shuffles), but in
another order: batches are loaded ahead, in worker processes, and skipped after a resume. So each
batch is loaded under streams seeded by its identity (`seeded`), the same whenever and wherever
it is loaded.
"""

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def _device_module(device: torch.device):
    """torch.cuda, torch.xpu, torch.mps, ... for an accelerator device; None for the CPU."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device)
    return module if hasattr(module, "get_rng_state") else None


def capture(device: torch.device) -> dict[str, torch.Tensor]:
    """The state of `random`, numpy, torch's CPU generator and `device`'s, as tensors only (a
    checkpoint loads them with `weights_only=True`; no pickled objects)."""
    version, internal, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "numpy": torch.tensor([pos, has_gauss, *keys.tolist()], dtype=torch.int64),
        # NaN stands for "no cached value" (a Gaussian draw is never NaN).
        "gauss": torch.tensor(
            [float("nan") if gauss_next is None else gauss_next, cached_gaussian],
            dtype=torch.float64,
        ),
        "torch": torch.get_rng_state(),
    }
    module = _device_module(device)
    if module is not None:
        state["accelerator"] = module.get_rng_state(device)
    return state


def restore(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back the streams `capture` described."""
    version, *internal = state["python"].tolist()
    gauss_next, cached_gaussian = state["gauss"].tolist()
    random.setstate((version, tuple(internal), None if np.isnan(gauss_next) else gauss_next))
    pos, has_gauss, *keys = state["numpy"].tolist()
    np.random.set_state(
        ("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian)
    )
    torch.set_rng_state(state["torch"])
    module = _device_module(device)
    if module is not None and "accelerator" in state:
        module.set_rng_state(state["accelerator"], device)


@contextmanager
def seeded(key: tuple[int, ...]) -> Iterator[None]:
    """Run a block with `random`, numpy and torch's CPU generator seeded from `key`, and the
    streams as they were afterwards.

    Only the CPU generator: data loading runs on the CPU, and `torch.manual_seed` would also
    reseed the accelerator's generator, which the training step draws from.
    """
    sequence = np.random.SeedSequence([int(k) for k in key])
    python_seed, torch_seed = (int(s) for s in sequence.generate_state(2, dtype=np.uint64))
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(python_seed)
    np.random.seed(sequence.generate_state(4))
    torch.default_generator.manual_seed(torch_seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
