"""The memory a training run will hold, said before it starts and checked against the machine.

A full Stable Diffusion fine-tune is close to what one machine holds, and every trainer in this
field lets its users find that out with an out-of-memory kill. The launcher prints this plan once
before training (and alone with `main.py --plan`), and stops with one line and exit status 2,
before the run folder exists, when the plan does not fit - naming what would make it fit.

Each part is computed from the built model, optimizer, strategy and callbacks, per rank, with
the model in the form the fit holds it (`as_the_fit_holds_it`: the training mode's fit start,
then its fit end):

    weights            trainable parameters in the dtype training keeps them
    gradients          one per trainable weight, same dtype
    optimizer state    per optimizer: AdamW two moments in the weight's dtype; 8-bit AdamW
                       (bitsandbytes) one byte each plus an fp32 absmax per block of 256 values
                       (tensors under 4096 values keep fp32 moments); DeepSpeed adds fp32 master
                       weights under mixed precision
    frozen parts       each frozen top-level module (VAE, text encoder) and the buffers, in
                       their dtypes; a LoRA's swapped blocks (`blocks_to_swap`) in host RAM and
                       their staging on the device instead (lun.memory_quant.block_swap_parts)
    activations        measured: one forward and backward pass of the largest bucket at the batch
                       size (allocations counted by torch's profiler on the CPU, the allocator's
                       peak on an accelerator), less the gradients it allocates; on an
                       accelerator not measured where the parts before it exceed the device,
                       and a lower bound where the device refuses the step (`_parts`)
    EMA                fp32 shadows (host RAM, or the device with `shadows: device`, or with
                       `shadows: auto` when the device's peak with them fits its budget) and
                       staging buffers in host RAM (lun.callbacks.ema)
    checkpoint save    nothing: the writer streams the tensors that exist (lun.atomic_io); a
                       snapshot of the whole checkpoint with Lightning's AsyncCheckpointIO, the
                       gathered weights and optimizer state with FSDP's full state dict
    process            the process's resident memory besides its model tensors

Strategies divide what they shard among the ranks that share it: ZeRO-1 the optimizer state,
ZeRO-2 also the gradients, ZeRO-3 also the weights; FSDP FULL_SHARD all three, SHARD_GRAD_OP the
gradients and optimizer state. Offloading moves parts to host RAM. Host RAM counts every process
this machine runs (one per local device).

Peaks: training holds everything but the checkpoint writer's part; saving holds what training
holds between steps (no activations) plus the writer's part; resuming holds weights, optimizer
state and EMA plus the one tensor being read (`lun.atomic_io.lazy_load_checkpoint`).
"""

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from lun import strategies
from lun.config import ConfigError
from lun.memory_parts import (
    ACTIVATIONS,
    CHECKPOINT_READ,
    CHECKPOINT_SAVE,
    DEVICE,
    EMA_STAGING,
    GRADIENTS,
    HOST,
    GiB,
    MemoryPlan,
    MemoryPlanError,
    Part,
    _gib,
)
from lun.memory_probe import measure_activations, probe_batch
from lun.strategies import Sharding

# bitsandbytes' 8-bit optimizers: blockwise quantized states with one fp32 absmax per block,
# and 32-bit states for tensors smaller than `min_8bit_size`.
BNB_BLOCK, BNB_MIN_8BIT_SIZE = 256, 4096
# State tensors per weight of torch's optimizers (the rest are scalars).
STATES_PER_WEIGHT = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adagrad": 1,
    "Lion": 1,
}
# Gradient checkpointing cut this UNet's activation memory by 76 % (README, Benchmarks).
CHECKPOINTING_SAVES = 0.75


# --- out of memory --------------------------------------------------------------------------
# An allocator that cannot give what is asked: accelerators raise torch.OutOfMemoryError, the
# CPU allocator a RuntimeError ("[enforce fail at alloc_cpu.cpp] ... DefaultCPUAllocator: can't
# allocate memory: you tried to allocate 34359738368 bytes. Error code 12"; "not enough memory"
# on Windows).
CPU_ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")
_ASKED = re.compile(r"tried to allocate ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# What shrinks the memory a step holds, each with the key that sets it.
OUT_OF_MEMORY_OPTIONS = (
    "a smaller batch (data.params.batch_size, with lightning.trainer.accumulate_grad_batches)",
    "gradient checkpointing (use_checkpoint: true in the backbone's params)",
    "a latent cache (scripts/cache_latents.py, then data.params.cache: no VAE in the step)",
    "a lower resolution (the train set's size)",
)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocator's refusal (not any other RuntimeError)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in CPU_ALLOCATOR_FAILURES)


def refused_bytes(err: BaseException) -> int | None:
    """The allocation an allocator's refusal names ("tried to allocate 2.00 GiB"), or None."""
    asked = _ASKED.search(str(err))
    return int(float(asked.group(1)) * _UNITS[asked.group(2).lower()]) if asked else None


def out_of_memory_message(err: BaseException, where: str, memory: str, limit: int | None) -> str:
    """One line for an allocator's refusal in `where`: what did not fit (the allocation it
    asked for, against `limit` bytes of `memory`) and the options that shrink a step."""
    size = refused_bytes(err)
    what = f"an allocation of {_gib(size)}" if size is not None else "an allocation"
    of = f" ({memory}: {_gib(limit)} in all)" if limit else f" ({memory})"
    return (
        f"out of memory in {where}: {what} did not fit{of}; "
        f"options: {'; '.join(OUT_OF_MEMORY_OPTIONS)}"
    )


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def _dtypes(tensors, dtype_of: Callable) -> str:
    return "/".join(sorted({_dtype_name(dtype_of(t)) for t in tensors})) or "-"


@dataclass
class Precision:
    """What the precision setting and the strategy make of the weights' dtypes."""

    true_dtype: torch.dtype | None  # "bf16-true" etc.: the whole module is cast
    master_weights: bool  # DeepSpeed under mixed precision: 16-bit module + fp32 master copy
    half: torch.dtype | None  # the 16-bit dtype of that module

    def weight_dtype(self, t: torch.Tensor, trainable: bool) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        if self.true_dtype is not None:
            return self.true_dtype
        if self.master_weights and trainable:
            return self.half
        return t.dtype


def _precision(trainer, sharding: Sharding) -> Precision:
    name = str(trainer.precision)
    half = {"bf16": torch.bfloat16, "16": torch.float16}.get(name.split("-")[0])
    true_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    master = sharding.half_weights_with_master and name.endswith("-mixed")
    return Precision(true_dtype.get(name), master, half)


def _configured_optimizers(model) -> list[torch.optim.Optimizer]:
    """The optimizers the fit will make; one whose package is not installed (adamw8bit without
    bitsandbytes) is a ConfigError here, before the run folder."""
    try:
        return _optimizers(model.configure_optimizers())
    except ImportError as err:
        raise ConfigError(f"model.params.optimizer_config: {err}") from err


def _optimizers(configured) -> list[torch.optim.Optimizer]:
    """The optimizers of any return value of `configure_optimizers`."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured for o in _optimizers(item)]
    return []


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, dtype_of: Callable, master_weights: bool = False
) -> tuple[int, str]:
    """(bytes, description) of the state `optimizer` keeps for its parameters.

    `dtype_of(param)`: the dtype training keeps the parameter in (torch's optimizers keep their
    moments in it). With `master_weights` (DeepSpeed mixed precision) the moments and a master
    copy of each weight are fp32.
    """
    name = type(optimizer).__name__
    params = _unique(p for group in optimizer.param_groups for p in group["params"])
    if type(optimizer).__module__.startswith("bitsandbytes"):
        states = 1 if any(k in name for k in ("Lion", "SGD", "Momentum", "RMSprop")) else 2
        args = getattr(optimizer, "args", None)
        min_size = getattr(args, "min_8bit_size", BNB_MIN_8BIT_SIZE)
        eight_bit = "8bit" in name
        total = 0
        for p in params:
            if eight_bit and p.numel() >= min_size:
                total += states * (p.numel() + math.ceil(p.numel() / BNB_BLOCK) * 4)
            else:
                total += states * p.numel() * 4
        what = "8-bit" if eight_bit else "fp32"
        return total, f"{name}, {states} {what} moments"
    if name == "SGD":
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
        states, assumed = int(momentum), ""
    else:
        states = STATES_PER_WEIGHT.get(name)
        assumed = "" if states is not None else " (assumed like AdamW)"
        states = 2 if states is None else states
        states += any(group.get("amsgrad") for group in optimizer.param_groups)
    if master_weights:
        total = (states + 1) * sum(p.numel() for p in params) * 4
        return total, f"{name}, {states} fp32 moments + fp32 master weights{assumed}"
    total = states * sum(p.numel() * torch.finfo(dtype_of(p)).bits // 8 for p in params)
    return total, f"{name}, {states} {_dtypes(params, dtype_of)} moments{assumed}"


def _frozen_parts(model: torch.nn.Module, precision: Precision, trainable_ids: set) -> list[Part]:
    """One part per top-level module with frozen weights or buffers, in their dtypes."""

    def dtype_of(t):
        return precision.weight_dtype(t, trainable=False)

    parts = []
    groups = [("buffers of the module", [*model.buffers(recurse=False)])]
    for name, child in model.named_children():
        tensors = [p for p in child.parameters() if id(p) not in trainable_ids]
        groups.append((name, tensors + list(child.buffers())))
    for name, tensors in groups:
        tensors = _unique(tensors)
        nbytes = sum(t.numel() * _size(dtype_of(t)) for t in tensors)
        if nbytes:
            count = sum(t.numel() for t in tensors)
            detail = f"{count / 1e6:.1f} M values, {_dtypes(tensors, dtype_of)}"
            parts.append(Part(f"frozen: {name}", nbytes, DEVICE, detail))
    return parts


def _frozen_bytes(precision: Precision) -> Callable[[torch.Tensor], int]:
    """A frozen tensor's bytes in the dtype the run holds it (block swap's parts and option)."""
    return lambda t: t.numel() * _size(precision.weight_dtype(t, trainable=False))


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _ema_parts(trainer, model, precision: Precision) -> list[Part]:
    from lun.callbacks.ema import find_ema

    ema = find_ema(trainer)
    if ema is None:
        return []
    params = [p for p in model.ema_module.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    staging = sum(p.numel() * _size(precision.weight_dtype(p, True)) for p in params)
    every = f"every {ema.update_every} step" + ("" if ema.update_every == 1 else "s")
    place = DEVICE if ema.on_device else HOST  # "auto" (None): placed by `place_ema`
    return [
        Part("EMA", count * 4, place, f"fp32 shadows, {every}"),
        Part(EMA_STAGING, staging, HOST, "a copy of the weights to average from"),
    ]


def place_ema(plan: MemoryPlan, ema) -> None:
    """`EMA(shadows="auto")`: move the shadows to the device when the device's peak with them
    stays within its budget (an unknown budget: they stay in host RAM), and tell the EMA."""
    if ema is None or ema.place != "auto":
        return
    part = next(p for p in plan.parts if p.name == "EMA")
    budget = plan.budget(DEVICE)
    fits = (
        DEVICE in plan.places()
        and budget is not None
        and plan.peak(DEVICE) + part.nbytes <= budget  # the shadows are in every peak
    )
    part.place = DEVICE if fits else HOST
    part.detail += ", on the device: room under its budget" if fits else ", in host RAM"
    ema.on_device = fits


def _checkpoint_save_part(trainer, weights: int, optimizer: int, ema: int, sharding) -> Part:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
        return Part(
            CHECKPOINT_SAVE,
            weights + optimizer + ema,
            HOST,
            "AsyncCheckpointIO snapshots the whole checkpoint",
        )
    if sharding.full_state_dict_gather and sharding.weights > 1:
        return Part(
            CHECKPOINT_SAVE,
            weights * sharding.weights + optimizer * sharding.optimizer,
            HOST,
            "FSDP gathers the full state on rank 0 (state_dict_type: sharded avoids it)",
        )
    return Part(CHECKPOINT_SAVE, 0, HOST, "streams the tensors that exist")


def _process_part(model, host_tensors=()) -> Part:
    """Resident memory of this process besides the model's tensors in CPU memory and
    `host_tensors` (the swapped blocks' host copies, counted in their own part)."""
    cpu_tensors = _unique(
        t for t in [*model.parameters(), *model.buffers(), *host_tensors] if t.device.type == "cpu"
    )
    rss = psutil.Process().memory_info().rss
    return Part("process", max(rss - _nbytes(cpu_tensors), 0), HOST, "Python, libraries, data")


# --- budgets --------------------------------------------------------------------------------
def host_memory_budget() -> int:
    """This machine's RAM, or the container's (cgroup) limit when lower: what the kernel's
    out-of-memory killer enforces."""
    budget = psutil.virtual_memory().total
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            budget = min(budget, int(text))
    return budget


def device_memory_budget(device: torch.device) -> int | None:
    if device.type == "cpu":
        return None
    return torch.accelerator.get_memory_info(device)[1]


# --- the plan -------------------------------------------------------------------------------
@contextmanager
def as_the_fit_holds_it(model, trainer) -> Iterator[None]:
    """`model` in the form the fit trains it while the plan counts and measures it: its training
    mode's fit-start preparation (`ldm.adapters.TrainingMode.on_fit_start`: a LoRA base in its
    training dtype, quantized, its blocks swapped onto the run's device), then its fit end
    (`on_fit_end`), which undoes what only the fit may hold (the swap) and leaves the rest (the
    dtype, the quantization), which the fit finds done. A module without a training mode (the
    VAE trainer) and full fine-tuning are planned as they are. A setting the preparation refuses
    (more blocks to swap than the backbone has) is a ConfigError here, before the run folder."""
    mode = getattr(model, "training_mode", None)
    if mode is None:
        yield
        return
    try:
        mode.on_fit_start(model, trainer, getattr(model, "strategy_casts_parameters", False))
    except ValueError as err:  # a setting the mode refuses (it names the key): before the run
        raise ConfigError(str(err).strip().splitlines()[0]) from err
    try:
        yield
    finally:
        mode.on_fit_end(model)


def memory_plan(
    model,
    trainer,
    batch=None,
    host_budget: int | None = None,
    device_budget: int | None = None,
    activations: int | None = None,
    device: torch.device | str | None = None,
) -> MemoryPlan:
    """The plan of training `model` with `trainer` (built, not yet fitted), in the form the fit
    holds it (`as_the_fit_holds_it`).

    `batch`: the probe batch (see `probe_batch`); its step's activations are measured unless
    `activations` is given. Budgets default to this machine's (`host_memory_budget`, the device's
    total memory). `device`: where the plan places the parts (default: the trainer's device,
    where the probe runs; another one plans an accelerator's run from this process).
    """
    device = torch.device(device) if device is not None else trainer.strategy.root_device
    world = trainer.num_devices * trainer.num_nodes
    local = trainer.num_devices
    sharding = strategies.sharding(trainer.strategy, world, local)
    precision = _precision(trainer, sharding)
    if device_budget is None:
        device_budget = device_memory_budget(device)
    with as_the_fit_holds_it(model, trainer):
        parts = _parts(
            model, trainer, batch, activations, device, sharding, precision, device_budget
        )
    plan = MemoryPlan(
        parts,
        str(device),
        local_ranks=local,
        host_budget=host_budget if host_budget is not None else host_memory_budget(),
        device_budget=device_budget,
    )
    from lun.callbacks.ema import find_ema

    place_ema(plan, find_ema(trainer) if any(p.name == "EMA" for p in parts) else None)
    plan.options = _options(plan, model, trainer, batch, sharding, precision)
    return plan


def _parts(
    model, trainer, batch, activations, device, sharding, precision, device_budget=None
) -> list[Part]:
    """The plan's parts (see the module's docstring), `model` as the fit holds it. No probe
    step where the device parts held before it exceed `device_budget` (`_too_big_to_probe`)."""
    trainable = _unique(p for p in model.parameters() if p.requires_grad)
    trainable_ids = {id(p) for p in trainable}

    def dtype_of(p):
        return precision.weight_dtype(p, trainable=True)

    weights = sum(p.numel() * _size(dtype_of(p)) for p in trainable)
    count = sum(p.numel() for p in trainable)
    where = HOST if sharding.weights_on_host else DEVICE
    parts = [
        Part(
            "weights (trainable)",
            weights // sharding.weights,
            where,
            f"{count / 1e6:.1f} M values, {_dtypes(trainable, dtype_of)}"
            + _shared(sharding.weights),
        ),
        Part(
            GRADIENTS,
            weights // sharding.gradients,
            where,
            _dtypes(trainable, dtype_of) + _shared(sharding.gradients),
        ),
    ]
    optimizer_total = 0
    for i, optimizer in enumerate(_configured_optimizers(model)):
        nbytes, detail = optimizer_state_bytes(optimizer, dtype_of, precision.master_weights)
        optimizer_total += nbytes // sharding.optimizer
        place = HOST if sharding.optimizer_on_host else DEVICE
        label = "optimizer state" + (f" {i + 1}" if i else "")
        parts.append(
            Part(label, nbytes // sharding.optimizer, place, detail + _shared(sharding.optimizer))
        )
    if sharding.buckets:
        size = _size(dtype_of(trainable[0]))
        detail = f"{sharding.buckets / 1e6:.0f} M values (reduce_bucket_size)"
        parts.append(Part("DeepSpeed buckets", sharding.buckets * size, DEVICE, detail))
    parts += _frozen_parts(model, precision, trainable_ids)  # swapped blocks: placeholders
    from lun.memory_quant import STAGING, block_swap_parts, quantization_state_part

    parts += quantization_state_part(model)  # bitsandbytes' scales: not parameters or buffers
    swap = block_swap_parts(model, str(device), _frozen_bytes(precision))
    parts += swap
    host_copies = _swapped_host_tensors(model)
    process = _process_part(model, host_copies)  # before the probe (its freed blocks stay)
    how = "measured by one probe step"
    if activations is None and (batch is None or model.steps_own_optimizers):
        # A module that steps its own optimizers (the VAE's GAN) cannot run a step without a
        # trainer: its activations are left out of the plan, and the plan says so.
        activations, how = 0, "not measured (no probe batch, or manual optimization)"
    elif activations is None and (held := _too_big_to_probe(parts, device, device_budget)):
        # The plan cannot fit whatever the step's activations: measuring them would only move
        # a model the device cannot hold there (an allocator refusal instead of the plan's
        # options). `blocks_to_swap` / `base_quantization: auto` try a smaller form next.
        activations, how = 0, f"not measured: the parts held before the step, {held}, do not fit"
    elif activations is None:
        try:
            activations = measure_activations(model, batch, trainer)
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            if device.type == "cpu" or device_budget is None:
                raise _refusal(err, f"the probe step (batch {_batch_size(batch)})", device) from err
            # The step did not fit the device: its activations are at least what the device had
            # left plus the allocation refused. The plan is then over budget, and its options
            # (block swap's N, a quantized base, ...) are the answer instead of a traceback.
            activations = at_least_the_refused_step(err, parts, device_budget)
            how = "at least: the probe step ran out of device memory"
        else:
            # The probe's peak holds the swapped blocks it streamed in (at most `resident` of
            # them, each at most the largest): the staging part counts them, so they come off
            # here - activations + staging is the measured peak, nothing counted twice.
            staging = sum(p.nbytes for p in swap if p.name == STAGING)
            if staging:
                activations = max(activations - staging, 0)
                how += f", less the {_gib(staging)} of swapped blocks it streamed in"
    parts.append(Part(ACTIVATIONS, activations, DEVICE, how))
    ema = _ema_parts(trainer, model, precision)
    parts += ema
    largest = max(
        (
            t.numel() * _size(precision.weight_dtype(t, t.requires_grad))
            for t in model.state_dict(keep_vars=True).values()
        ),
        default=0,
    )
    parts.append(
        _checkpoint_save_part(
            trainer,
            weights // sharding.weights,
            optimizer_total,
            ema[0].nbytes if ema else 0,  # the shadows; staging is written only when swapped
            sharding,
        )
    )
    parts.append(Part(CHECKPOINT_READ, largest, HOST, "a resume reads one tensor at a time"))
    parts.append(process)
    if device.type == "cpu":
        for part in parts:
            part.place = HOST
    return parts


def _on_device(parts: list[Part]) -> int:
    """Bytes of the device `parts` (those planned before the probe step: what it holds)."""
    return sum(p.nbytes for p in parts if p.place == DEVICE)


def at_least_the_refused_step(err: BaseException, parts: list[Part], budget: int) -> int:
    """A lower bound of the activations of a probe step that the device's allocator refused:
    the device's `budget` less the device `parts` held before the step, plus the allocation
    it refused (`tried to allocate X` in the error; at least one byte, so that the plan is over
    its budget)."""
    return max(budget - _on_device(parts), 0) + max(refused_bytes(err) or 0, 1)


def _too_big_to_probe(parts: list[Part], device: torch.device, budget: int | None) -> str:
    """'X GiB of the device's Y GiB' where an accelerator's parts before the probe step already
    exceed its `budget`, else ''."""
    held = _on_device(parts)
    if device.type == "cpu" or budget is None or held <= budget:
        return ""
    return f"{_gib(held)} of the device's {_gib(budget)}"


def _swapped_host_tensors(model) -> list[torch.Tensor]:
    from ldm.block_swap import swaps_in

    return [t for swap in swaps_in(model) for block in swap.host_tensors() for t in block]


def _shared(ranks: int) -> str:
    return f", 1/{ranks} per rank" if ranks > 1 else ""


def _eight_bit_bytes(optimizer) -> int:
    """What bitsandbytes' AdamW8bit would keep for `optimizer`'s parameters."""
    params = _unique(p for group in optimizer.param_groups for p in group["params"])
    return sum(
        2 * (p.numel() + math.ceil(p.numel() / BNB_BLOCK) * 4)
        if p.numel() >= BNB_MIN_8BIT_SIZE
        else 2 * p.numel() * 4
        for p in params
    )


def _options(
    plan: MemoryPlan, model, trainer, batch, sharding: Sharding, precision: Precision
) -> list[dict]:
    """What would shrink the plan, each with the memory it saves per place (a machine's host RAM
    counts all its processes): the options a user has in this trainer's configs."""
    parts = {p.name: p for p in plan.parts}

    def saves(*shares: tuple[str, float]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, fraction in shares:
            part = parts.get(name)
            if part is not None:
                ranks = plan.local_ranks if part.place == HOST else 1
                out[part.place] = out.get(part.place, 0) + int(part.nbytes * fraction) * ranks
        return out

    options = []
    if model.gradient_checkpointing is False:  # the contract: None when it has none
        options.append(
            {
                "name": "gradient checkpointing",
                "how": "use_checkpoint: true in the backbone's params (unet_config, or network_config in sgm configs)",
                "saves": saves((ACTIVATIONS, CHECKPOINTING_SAVES)),
            }
        )
    optimizers = _configured_optimizers(model)
    if len(optimizers) == 1 and type(optimizers[0]).__name__ in ("Adam", "AdamW"):
        state = parts["optimizer state"]
        eight_bit = _eight_bit_bytes(optimizers[0]) // sharding.optimizer
        if state.nbytes > eight_bit:
            fraction = 1 - eight_bit / state.nbytes
            options.append(
                {
                    "name": "8-bit AdamW",
                    "how": "model.params.optimizer_config.target=adamw8bit",
                    "saves": saves(("optimizer state", fraction)),
                }
            )
    size = _batch_size(batch)
    if size > 1:
        accumulate = trainer.accumulate_grad_batches * size
        options.append(
            {
                "name": "batch 1 + accumulation",
                "how": f"data.params.batch_size=1 lightning.trainer.accumulate_grad_batches={accumulate}",
                "saves": saves((ACTIVATIONS, 1 - 1 / size)),
            }
        )
    if "EMA" in parts:
        options.append(
            {
                "name": "no EMA",
                "how": "~lightning.callbacks.ema",
                "saves": saves(("EMA", 1), (EMA_STAGING, 1)),
            }
        )
    if plan.device != "cpu" and not sharding.optimizer_on_host:
        options.append(
            {
                "name": "ZeRO-2 optimizer offload",
                "how": "--base configs/lightning/deepspeed_stage2.yaml",
                "saves": {DEVICE: parts["optimizer state"].nbytes},
            }
        )
    from lun.memory_quant import swap_option

    options += swap_option(  # a LoRA's frozen blocks to host RAM
        plan, model, _frozen_bytes(precision)
    )
    options.append(
        {
            "name": "LoRA",
            "how": "train adapters instead of the weights",
            "saves": saves((GRADIENTS, 1), ("optimizer state", 1), ("EMA", 1), (EMA_STAGING, 1)),
        }
    )
    return options


def _batch_size(batch) -> int:
    if batch is None:
        return 1
    from lun.callbacks.measure import batch_size_of

    return batch_size_of(batch)


def _refusal(err: BaseException, where: str, device: torch.device) -> MemoryPlanError:
    """The plan's one line for an allocator's refusal while measuring or training."""
    if device.type == "cpu":
        memory, limit = "host RAM", host_memory_budget()
    else:
        memory, limit = f"{device} memory", device_memory_budget(device)
    return MemoryPlanError("memory plan: " + out_of_memory_message(err, where, memory, limit))


def out_of_memory_in_training(err: BaseException, trainer) -> MemoryPlanError:
    """The one line for an allocator's refusal inside `trainer.fit` (a step, sampling)."""
    step = trainer.global_step
    where = "the first training step" if step == 0 else f"training at step {step}"
    return _refusal(err, where, trainer.strategy.root_device)


def plan_run(model, data, trainer, host_gib: float | None = None, device_gib: float | None = None):
    """The launcher's plan: the probe batch from `data`, budgets in GiB (None: the machine's)."""
    try:
        batch = probe_batch(data)
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        where = f"the probe batch (batch {data.batch_size('train')})"
        raise _refusal(err, where, trainer.strategy.root_device) from err
    from lun.memory_quant import plan_with_quantization

    return plan_with_quantization(  # a quantized base: quantized before it is measured
        model,
        trainer,
        lambda: memory_plan(
            model,
            trainer,
            batch,
            host_budget=None if host_gib is None else int(host_gib * GiB),
            device_budget=None if device_gib is None else int(device_gib * GiB),
        ),
    )
