"""What a batch and a device say about a step: its number of samples and the accelerator's peak
memory. The progress bar, throughput, epoch statistics and the other callbacks read them; they
live apart so that no callback imports another for them (no import circle)."""

from collections.abc import Mapping, Sequence

import torch


def batch_size_of(batch) -> int:
    """Number of samples in a batch dict (`image`, `latent`, else the first tensor or list)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        for key in ("image", "latent"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key].shape[0]
        values = list(batch.values())
    else:
        values = list(batch) if isinstance(batch, Sequence) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    for value in values:
        if isinstance(value, Sequence) and not isinstance(value, str):
            return len(value)
    raise ValueError(f"cannot tell the batch size of a {type(batch).__name__}")


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak memory allocated on an accelerator since the last reset; None on CPU."""
    if device.type == "cpu":
        return None
    return torch.accelerator.max_memory_allocated(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
