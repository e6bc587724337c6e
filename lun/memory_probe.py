"""Activation memory of one training step, measured rather than guessed (for lun.memory's plan).

One forward and backward pass of the largest bucket at the batch size, with the allocations
counted by torch's profiler on the CPU (the resident set hides freed blocks the heap keeps) and
by the allocator's peak on an accelerator. The probe leaves the run's random streams, weights and
gradients as they were, so a run with the plan trains exactly like one without.
"""

import copy
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto writes a line straight to file descriptor 2 when the profiler starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors allocated on `device` while `fn` runs, above those live before it.

    On an accelerator the allocator keeps the peak; on the CPU, torch's profiler records every
    allocation and free (the allocations themselves, not the resident set, which a heap that
    keeps freed blocks hides).
    """
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
        torch.accelerator.reset_peak_memory_stats(device)
        before = torch.accelerator.memory_allocated(device)
        fn()
        torch.accelerator.synchronize(device)
        return torch.accelerator.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        profiler.__enter__()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            profiler.__exit__(None, None, None)
    events = [
        e
        for e in profiler.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@contextmanager
def _same_random_streams(device: torch.device) -> Iterator[None]:
    """The probe draws noise, timesteps and dropout: the run's random streams stay untouched."""
    python, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def probe_batch(data) -> dict | None:
    """One training batch at the largest bucket and the batch size, or None when the data cannot
    tell. A map-style set gives its first item (resized: only its shape matters), repeated; a
    stream (WebDataset, Parquet), which cannot be indexed, gives the first batch it would load -
    all its images have the configured size."""
    dataset = getattr(data, "datasets", {}).get("train")
    if dataset is None:
        return None
    batch_size = data.batch_size("train") if hasattr(data, "batch_size") else 1
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return _first_streamed_batch(dataset, batch_size)
    if not hasattr(dataset, "__getitem__"):
        return None
    item = dataset[0]
    sizes = getattr(dataset, "bucket_sizes", None)
    if sizes and isinstance(item.get("image"), torch.Tensor):
        width, height = max(sizes, key=lambda wh: wh[0] * wh[1])
        image = item["image"].unsqueeze(0)
        item = {**item, "image": F.interpolate(image, size=(height, width), mode="nearest")[0]}
    collate = getattr(dataset, "collate", torch.utils.data.default_collate)
    return collate([item] * batch_size)


def _first_streamed_batch(dataset, batch_size: int) -> dict | None:
    """The stream's first batch, read here (no workers) from a copy configured for one process
    and no shuffle buffer (which would read a hundred samples before the first), leaving the
    run's own stream and random streams as they were."""
    if not hasattr(dataset, "configure"):
        return None  # the DataModule names an unsharded stream when it builds the loader
    probe = copy.copy(dataset)
    probe.configure(batch_size, shuffle=False)
    with _same_random_streams(torch.device("cpu")):
        return next(iter(probe), None)


def measure_activations(model, batch, trainer) -> int:
    """Peak activation memory of one training step (forward and backward) on the run's device,
    without the gradients; the weights, random streams and gradients are left as they were."""
    device = trainer.strategy.root_device
    # Where the model lives (a swapped block's empty placeholders are on the run's device
    # already: `lun.memory.as_the_fit_holds_it`); `model.to(device)` moves them and the rest.
    was = next(p.device for p in model.parameters() if p.numel())
    trainable = [p for p in model.parameters() if p.requires_grad]
    name = str(trainer.precision)
    true_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(name)
    with _same_random_streams(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a trainer
        model.to(device)
        batch = _to(batch, device)
        if true_dtype is not None:  # the module is cast when training starts; autocast is close
            context = torch.autocast(device.type, dtype=true_dtype)
        else:
            context = trainer.precision_plugin.forward_context()

        def step():
            with context:
                out = model.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()

        try:
            peak = peak_allocated(step, device)
        finally:
            model.zero_grad(set_to_none=True)
            model.to(was)
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    return max(peak - gradients, 0)


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
