"""Exponential moving average (EMA) of the trainable UNet weights, kept in CPU memory.

Sampling from an EMA of the weights (Polyak & Juditsky 1992) gives visibly better images than the
raw weights; every Stable Diffusion release was trained with one (`LitEma`, decay 0.9999). The
original keeps the fp32 copy on the GPU - 3.4 GB for the SD UNet. Here it lives in (pinned) CPU
memory: after an optimizer step the weights are copied device -> CPU on a side stream and folded
into the average by a worker thread, while the accelerator already runs the next step. Nothing
is allocated on the accelerator, and the device only waits for that copy before the *next*
optimizer step overwrites the weights it is reading.

Checkpoints carry the shadows in the original naming rule (`model_ema.` + parameter name without
dots, plus `model_ema.decay` and `model_ema.num_updates`), so original tools and
`ldm.checkpoint.load_weights(..., ema=True)` find them.

Distributed: under DDP (and DeepSpeed ZeRO-1/2) every rank holds the full, identical weights after
each optimizer step, so every rank keeps its own average and they never diverge; only rank 0
writes checkpoints. Strategies that shard the weights (FSDP, ZeRO-3) hand each rank a shard:
`EMA._full_weights` gathers them for the update and shards the EMA back for a swap (one
collective per update, on every rank; `lun.strategies.gathered_parameters`), so the average is
the same full fp32 copy in CPU memory whatever the strategy. With `update_every` > 1 the gathers
are that much rarer.
"""

import math
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ldm.layout.ema import EMA_PREFIX, EMA_SCALARS, ema_key
from ldm.layout.wrappers import without_wrapper_levels
from lun.atomic_io import materialized
from lun.strategies import gathered_parameters, shards_weights

WARMUPS = ("none", "litema", "power")
PLACES = ("host", "device", "auto")  # where the shadows live (`EMA(shadows=...)`)
PROBE_STEPS = 3  # optimizer steps timed after the first update, to choose `update_every="auto"`
DECAY_KEY, NUM_UPDATES_KEY = EMA_SCALARS


def choose_update_every(update_s: float, step_s: float, budget: float) -> int:
    """The fewest steps between updates that keep one update's cost within `budget` of the
    steps' time: N = ceil(update / (budget * step)). (Counting the whole copy+fold as lost is the
    worst case: an asynchronous fold that finishes within N steps costs less.)"""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(update_s / (budget * step_s) - 1e-9))


def find_ema(trainer) -> "EMA | None":
    return next((cb for cb in trainer.callbacks if isinstance(cb, EMA)), None)


@contextmanager
def ema_weights(trainer, pl_module) -> Iterator[None]:
    """Run a block with the EMA weights in `pl_module.ema_module`, and the raw weights back after.

    The one swap used by the image logger and validation (`EMA(validate_with_ema=True)`):

        with ema_weights(trainer, pl_module):
            images = pl_module.log_images(batch)

    A no-op when the trainer has no EMA callback, before its first training step, or when the
    EMA weights are already swapped in (so nested uses are safe). Outside training, for a saved
    checkpoint, `ldm.checkpoint.load_weights(model, path, ema=True)` loads the same shadows.
    """
    ema = find_ema(trainer)
    if ema is None or ema.shadows is None or ema.swapped:
        yield
        return
    ema.swap_in(pl_module)
    try:
        yield
    finally:
        ema.swap_out()


class EMA(Callback):
    """EMA of the trainable weights of `pl_module.ema_module` (the backbone), in CPU memory.

    Args:
        decay: the average keeps `decay` of itself per optimizer step (0.9999 as in SD: a
            horizon of ~10k steps). When updating every N steps the average keeps decay^N, so
            the horizon in steps does not depend on N.
        update_every: fold the weights in every this many optimizer steps (not micro-batches:
            gradient accumulation does not change it). Larger values cost less CPU time.
            "auto": pick the smallest N whose updates cost at most `budget` of the step time.
            Either way the first update (copy + fold, inline) and the next few steps are timed
            and one line says the choice and its cost (and, over the budget, the N that fits).
        budget: the share of the step time `update_every="auto"` allows the EMA (0.03 = 3 %).
        warmup: how the decay starts, as a function of the update count n (steps):
            "litema": min(decay, (1 + n) / (10 + n)) - the original LitEma (`use_num_upates`);
            "power": min(decay, 1 - n^-warmup_power) - k-diffusion's `EMAWarmup` (inv_gamma 1);
            power 2/3 reaches 0.999 at ~32k steps and 0.9999 at 1M, 3/4 at 10k and 215k;
            "none": always `decay`.
        warmup_power: exponent of the "power" warm-up.
        validate_with_ema: run validation with the EMA weights swapped in (what you would
            ship), so a monitored `val/loss` ranks EMA checkpoints.
        async_update: fold the weights in on a worker thread while training goes on (the same
            result, bit for bit); False does it inline.
        pin_memory: page-locked CPU buffers (faster, asynchronous device -> CPU copies); only
            used when the model is on an accelerator.
        shadows: where the fp32 shadows live. "host" (default): host RAM, as above - nothing
            on the accelerator. "device": the accelerator's memory, as the original LitEma
            (+4 bytes per trainable weight there; the fold is then one on-device kernel per
            update, with no copy and no host thread; the staging buffers stay in host RAM, for
            swaps). "auto": the device when the launcher's memory plan (lun.memory) finds
            room for them under its device budget, else host RAM. On a CPU-only run all three
            are the same.
    """

    def __init__(
        self,
        decay: float = 0.9999,
        update_every: int | str = 1,
        budget: float = 0.03,
        warmup: str | None = "litema",
        warmup_power: float = 2 / 3,
        validate_with_ema: bool = True,
        async_update: bool = True,
        pin_memory: bool = True,
        shadows: str = "host",
    ):
        if shadows not in PLACES:
            raise ValueError(f"shadows={shadows!r}: expected one of {', '.join(PLACES)}")
        warmup = warmup or "none"
        if warmup not in WARMUPS:
            raise ValueError(f"EMA warmup must be one of {', '.join(WARMUPS)}, got '{warmup}'")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.auto = update_every == "auto"
        if not self.auto and not (isinstance(update_every, int) and update_every >= 1):
            raise ValueError(
                f"EMA update_every must be an integer >= 1 or 'auto', got {update_every}"
            )
        if not 0 < budget < 1:
            raise ValueError(f"EMA budget must be in (0, 1), got {budget}")
        self.decay, self.update_every, self.budget = decay, 1 if self.auto else update_every, budget
        self._decided = not self.auto
        self._reported = False  # the line with the choice and its cost (each run prints one)
        self._update_seconds = 0.0  # the timed first update
        self._probe_start: tuple[int, float] | None = None  # (step, time) after it
        self._probe_updates_s = 0.0  # time spent in updates while the steps after it are timed
        self.warmup, self.warmup_power = warmup, warmup_power
        self.validate_with_ema = validate_with_ema
        self.async_update = async_update
        self.pin_memory = pin_memory
        self.place = shadows
        # "auto": set by the memory plan (`lun.memory`); no plan made: host RAM.
        self.on_device: bool | None = {"host": False, "device": True}.get(shadows)
        self.shadows: dict[str, torch.Tensor] | None = None  # name -> fp32 CPU average
        self._staging: dict[str, torch.Tensor] | None = None  # name -> CPU copy of the weights
        self.num_updates = 0  # optimizer steps folded into the average
        self._last_update_step: int | None = None
        self._loaded: dict | None = None  # from a checkpoint, applied once the buffers exist
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._copy_stream: torch.Stream | None = None
        self._copy_done: torch.Event | None = None
        self._swapped_module = None  # the module holding the EMA weights, while swapped in
        self._params: dict[str, torch.Tensor] | None = None  # built once (unsharded strategies)
        self._params_of = None  # the module they belong to
        self._where = "host RAM"
        self._lists: tuple[list, list, list] | None = None  # (params, staging, shadows), in order
        self._fp32 = True  # are the weights (and so the staging buffers) all fp32?

    # --- the average -------------------------------------------------------------------------
    def decay_at(self, n: int) -> float:
        """Decay applied at the n-th optimizer step (n >= 1)."""
        if self.warmup == "litema":
            return min(self.decay, (1 + n) / (10 + n))
        if self.warmup == "power":
            return min(self.decay, 1 - n**-self.warmup_power)
        return self.decay

    @staticmethod
    def _trainable_params(pl_module) -> dict[str, torch.Tensor]:
        """The trainable parameters of `pl_module.ema_module` by name (possibly shards: read
        them inside `_full_weights`).

        Names are those of the module (`diffusion_model.input_blocks.0.0.weight` for
        `LatentDiffusion.model`); levels that wrappers add (torch.compile, FSDP) are dropped.
        """
        named = pl_module.ema_module.named_parameters()
        return {without_wrapper_levels(name): p for name, p in named if p.requires_grad}

    @staticmethod
    def _checkpoint_keys(pl_module) -> dict[str, str]:
        """Name in `ema_module` -> the weight's key in the module's state dict: found by the
        parameter itself, so it holds for a submodule (`model.` + name for LatentDiffusion.model)
        and for a view of the module's own parts (the autoencoder's generator: the same names)."""
        own = {id(p): without_wrapper_levels(n) for n, p in pl_module.named_parameters()}
        named = pl_module.ema_module.named_parameters()
        return {without_wrapper_levels(n): own[id(p)] for n, p in named if p.requires_grad}

    @contextmanager
    def _full_weights(self, pl_module, modify: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The full trainable weights by name - the only place reading (or writing) them.

        Under FSDP / ZeRO-3 they are gathered for the block (every rank must enter it) and, with
        `modify`, what the block wrote is sharded back on exit.
        """
        trainer = getattr(pl_module, "_trainer", None)
        if trainer is None or not shards_weights(trainer.strategy):
            # The parameters are the same tensors all run long: the dict is built once.
            if self._params is None or self._params_of is not pl_module:
                self._params, self._params_of = self._trainable_params(pl_module), pl_module
                self._lists = None
            yield self._params
            return
        params = self._trainable_params(pl_module)
        with gathered_parameters(trainer.strategy, params, modify=modify):
            yield params

    @staticmethod
    def _check_strategy(trainer) -> None:
        from lun.strategies import strategy_kind

        if strategy_kind(trainer.strategy) == "model_parallel":
            raise ValueError(
                "EMA needs the full weights, and ModelParallelStrategy (DTensor) has no gather here. "
                "Use DDP, DeepSpeed or FSDP with EMA, or remove the EMA callback."
            )

    def _update(self, pl_module, step: int) -> None:
        steps = step - self._last_update_step
        # Keep the product of the per-step decays: the same weight the old average would have
        # after `steps` single-step updates (decay^N for a constant decay).
        keep = math.prod(self.decay_at(self.num_updates + k) for k in range(1, steps + 1))
        self.num_updates += steps
        self._last_update_step = step
        self._finish()  # the staging buffers are free again
        timed = not self._reported and self._probe_start is None
        start = time.perf_counter()
        with self._full_weights(pl_module) as params:
            device = next(iter(params.values())).device
            if next(iter(self.shadows.values())).device == device:
                # Shadows beside the weights (host memory, or both on the device): fold them in
                # directly, now. A staging copy for a worker thread would cost more CPU time
                # than the fold it lets overlap (and training already keeps the cores busy); on
                # a device the fold is queued on its stream like the step's own kernels.
                on_device = device.type != "cpu"
                if timed and on_device:  # time the fold's kernels, not the step's still queued
                    torch.accelerator.synchronize(device)
                    start = time.perf_counter()
                self._fold_in(1.0 - keep, None, self._ordered(params)[0])
                if timed:
                    if on_device:  # once, for the plan: the kernels' time, not their launch
                        torch.accelerator.synchronize(device)
                    self._update_seconds = time.perf_counter() - start
                    self._probe_start = (step, time.perf_counter())
                elif self._probe_start is not None:
                    self._probe_updates_s += time.perf_counter() - start
                return
            self._stage(params)
            if self._copy_done is not None and shards_weights(pl_module.trainer.strategy):
                # Gathered weights are freed when the block ends: the copy must have read them.
                self._copy_done.synchronize()
        if timed:  # the first update of "auto", inline: its whole cost, copy and fold
            self._fold_in(1.0 - keep, self._copy_done)
            self._update_seconds = time.perf_counter() - start
            self._probe_start = (step, time.perf_counter())
        elif self._executor is not None:
            self._pending = self._executor.submit(self._fold_in, 1.0 - keep, self._copy_done)
        else:
            self._fold_in(1.0 - keep, self._copy_done)
        if self._probe_start is not None and not timed:  # not the step's own time
            self._probe_updates_s += time.perf_counter() - start

    def _stage(self, params: dict[str, torch.Tensor]) -> None:
        """Copy the accelerator's weights into the CPU staging buffers, asynchronously.

        Side stream: the copy overlaps the next forward/backward; it starts after the optimizer
        step that produced these weights and must end before the next one
        (`on_before_optimizer_step` makes the device wait for `_copy_done`)."""
        device = next(iter(params.values())).device
        sources, staging, _ = self._ordered(params)
        if self._copy_stream is None:
            self._copy_stream = torch.Stream(device=device)
        copy_stream = self._copy_stream
        copy_stream.wait_stream(torch.accelerator.current_stream(device))
        with copy_stream:
            torch._foreach_copy_(staging, sources, non_blocking=True)  # one call for all tensors
        self._copy_done = copy_stream.record_event()

    def _fold_in(
        self, weight: float, copy_done: torch.Event | None, sources: list | None = None
    ) -> None:
        """shadow <- shadow + weight * (source - shadow), on the CPU; the source is the staging
        buffers unless given (the weights themselves, when they are in host memory)."""
        if copy_done is not None:
            copy_done.synchronize()
        _, staging, shadows = self._ordered(None)
        sources = staging if sources is None else sources
        if self._fp32:  # the staging buffers have the weights' dtypes
            torch._foreach_lerp_(shadows, sources, weight)  # one call for all tensors
        elif shadows[0].device.type != "cpu":  # on the device: one fp32 copy at a time
            for shadow, source in zip(shadows, sources, strict=True):
                shadow.lerp_(source.float(), weight)
        else:
            torch._foreach_lerp_(shadows, [s.float() for s in sources], weight)

    def _ordered(self, params: dict[str, torch.Tensor] | None) -> tuple[list, list, list]:
        """(detached weights, staging buffers, shadows) as parallel lists for the foreach
        kernels; built once while the weights are the same tensors (gathered ones are new)."""
        if params is not None and (self._lists is None or params is not self._params):
            names = list(self.shadows)
            lists = ([params[n].detach() for n in names], [self._staging[n] for n in names])
            self._lists = (*lists, [self.shadows[n] for n in names])
            self._fp32 = all(w.dtype == torch.float32 for w in lists[0])  # checked once
        return self._lists

    def _finish(self) -> None:
        """Wait for the update in flight (re-raising its error); the shadows are then current."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    # --- buffers and checkpoints -------------------------------------------------------------
    def _allocate(self, pl_module) -> None:
        with self._full_weights(pl_module) as params:
            if not params:
                raise ValueError("EMA: pl_module.ema_module has no trainable parameters")
            device = next(iter(params.values())).device
            pin = self.pin_memory and device.type != "cpu"
            beside = bool(self.on_device) and device.type != "cpu"  # shadows on the accelerator
            where = device if beside else torch.device("cpu")
            if self.shadows is None or self.shadows.keys() != params.keys():
                self.shadows = {
                    n: torch.empty(
                        p.shape, dtype=torch.float32, device=where, pin_memory=pin and not beside
                    )
                    for n, p in params.items()
                }
                with torch.no_grad():
                    for name, p in params.items():
                        self.shadows[name].copy_(p)
                self.num_updates = 0
            self._staging = {
                n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for n, p in params.items()
            }
            self._lists = None
            self._where = "pinned host RAM" if pin else "host RAM"
            if beside:
                self._where = f"{device.type} memory"

    def _apply_loaded(self) -> None:
        loaded, self._loaded = self._loaded, None
        by_key = {ema_key(name): name for name in self.shadows}
        missing = sorted(set(by_key) - loaded["shadows"].keys())
        unexpected = sorted(loaded["shadows"].keys() - set(by_key))
        if missing or unexpected:
            raise ValueError(
                "EMA: the checkpoint's model_ema.* shadows do not match the trainable parameters: "
                f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})"
            )
        shadows = loaded["shadows"]
        for key in list(shadows):  # each read (or freed) as soon as it is copied
            self.shadows[by_key[key]].copy_(shadows.pop(key))
        self.num_updates = loaded["num_updates"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.shadows is None:
            return
        self._finish()
        # The tensors themselves, not copies: the writer (lun.atomic_io) streams them to the file
        # before training goes on, so saving needs no memory beyond its small buffers (a copy of
        # every shadow was +3.4 GB for SD 1.x, on top of everything training holds). A writer that
        # returns first (Lightning's AsyncCheckpointIO) snapshots the whole checkpoint itself.
        state = checkpoint["state_dict"]
        if self.swapped:
            # Saved from inside an EMA block: the module's weights are the EMA; store the raw ones.
            if pl_module.device.type != "cpu":
                torch.accelerator.synchronize(pl_module.device)
            keys = self._checkpoint_keys(pl_module)
            for name, raw in self._staging.items():
                state[keys[name]] = raw
        for name, shadow in self.shadows.items():
            state[ema_key(name)] = shadow
        state[DECAY_KEY] = torch.tensor(self.decay, dtype=torch.float32)
        state[NUM_UPDATES_KEY] = torch.tensor(self.num_updates, dtype=torch.int32)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict", {})
        shadows = {
            k: v for k, v in state.items() if k.startswith(EMA_PREFIX) and k not in EMA_SCALARS
        }
        if not shadows:
            rank_zero_warn(
                "EMA: the checkpoint has no model_ema.* weights; the average restarts from the model"
            )
            return
        # Shadows may still be in the file (lun.atomic_io loads lazily): each is read when
        # `_apply_loaded` copies it into its buffer, so a resume holds no second full EMA.
        num_updates = int(materialized(state.get(NUM_UPDATES_KEY, torch.tensor(0))))
        self._loaded = {"shadows": shadows, "num_updates": max(num_updates, 0)}

    def state_dict(self) -> dict:
        # The shadows themselves travel in checkpoint["state_dict"] (original layout).
        return {
            "last_update_step": self._last_update_step,
            "decay": self.decay,
            "update_every": "auto" if self.auto else self.update_every,
            "warmup": self.warmup,
            # what "auto" chose: a resume goes on with it instead of timing again
            "chosen_update_every": self.update_every if self._decided else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        mine = {"decay": self.decay, "warmup": self.warmup}
        mine["update_every"] = "auto" if self.auto else self.update_every
        changed = [k for k, v in mine.items() if state_dict.get(k) != v]
        if changed:
            rank_zero_warn(
                f"EMA: {', '.join(changed)} differ from the checkpoint's; using the new values"
            )
        self._last_update_step = state_dict["last_update_step"]
        if self.auto and state_dict.get("chosen_update_every"):
            self.update_every, self._decided = state_dict["chosen_update_every"], True

    # --- swapping ----------------------------------------------------------------------------
    @property
    def swapped(self) -> bool:
        return self._swapped_module is not None

    def swap_in(self, pl_module) -> None:
        """Put the EMA weights into `pl_module.ema_module`; the raw ones wait in the CPU staging
        buffers, so swapping costs no accelerator memory (dtypes converted on the CPU side)."""
        if self.swapped:
            raise RuntimeError("EMA weights are already swapped in")
        self._finish()
        with self._full_weights(pl_module, modify=True) as params, torch.no_grad():
            for name, p in params.items():
                self._staging[name].copy_(p, non_blocking=True)  # same stream: before the write
                shadow = self.shadows[name]
                p.copy_(shadow if shadow.dtype == p.dtype else shadow.to(p.dtype))
        self._swapped_module = pl_module

    def swap_out(self) -> None:
        """Put the raw weights back."""
        if self._swapped_module is None:
            return
        pl_module, self._swapped_module = self._swapped_module, None
        with self._full_weights(pl_module, modify=True) as params, torch.no_grad():
            for name, p in params.items():
                p.copy_(self._staging[name], non_blocking=True)

    # --- hooks -------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._check_strategy(trainer)
            if self.place == "auto":
                # Only rank 0 makes the memory plan (main.py): every rank takes its choice, so
                # all keep their shadows in the same place (none planned: host RAM).
                self.on_device = bool(trainer.strategy.broadcast(self.on_device, src=0))
            if self.async_update and self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")

    def on_train_start(self, trainer, pl_module) -> None:
        # Here, not at fit start: every strategy has restored weights and step count by now.
        self._allocate(pl_module)
        if self._loaded is not None:
            self._apply_loaded()
        if self._last_update_step is None:
            self._last_update_step = trainer.global_step
        self._reported, self._probe_start, self._probe_updates_s = False, None, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step counts optimizer steps, so accumulated micro-batches do not update.
        step = trainer.global_step
        if not self._reported and self._probe_start is not None:
            if step - self._probe_start[0] >= PROBE_STEPS:
                self._decide(step, trainer)
        if not self._decided:  # "auto" while it times: no update until N is chosen
            if self._probe_start is None and step > self._last_update_step:
                self._update(pl_module, step)  # timed
            return
        if step - self._last_update_step >= self.update_every:
            self._update(pl_module, step)

    def _decide(self, step: int, trainer) -> None:
        """Print the plan and its cost (choosing `update_every` first for "auto") from the timed
        update and the steps that followed it (the time of their own updates left out). Rank 0's
        figures, on every rank: each rank times its own steps, and ranks choosing different N
        would fold at different steps - under FSDP or DeepSpeed stage 3 an update gathers the
        weights, a collective that the ranks not updating never join (the run hangs)."""
        first, started = self._probe_start
        step_s = (time.perf_counter() - started - self._probe_updates_s) / (step - first)
        self._update_seconds, step_s = trainer.strategy.broadcast(
            (self._update_seconds, step_s), src=0
        )
        fitting = choose_update_every(self._update_seconds, step_s, self.budget)
        if not self._decided:
            self.update_every, self._decided = fitting, True
        self._reported = True
        share = self._update_seconds / (self.update_every * max(step_s, 1e-12))
        advice = ""
        if share > self.budget:
            advice = (
                f"; over the budget: update_every={fitting} (or 'auto') would fit "
                "(lightning.callbacks.ema.params.update_every)"
            )
        rank_zero_info(
            f"EMA: shadows in {self._where}, updated every {self.update_every} optimizer "
            f"step(s): copy+fold {1e3 * self._update_seconds:.1f} ms, step {1e3 * step_s:.1f} ms, "
            f"{100 * share:.1f} % of the step (budget {100 * self.budget:.0f} %){advice}"
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._copy_done is not None:
            # The device (not the host) waits until the last copy has read the weights.
            torch.accelerator.current_stream(pl_module.device).wait_event(self._copy_done)
            self._copy_done = None

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if self.validate_with_ema and self.shadows is not None and not self.swapped:
            self.swap_in(pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # Before on_validation_end, where ModelCheckpoint saves: checkpoints hold raw weights.
        self.swap_out()

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Runs before the checkpoint callbacks' on_exception: they must save the raw weights.
        self.swap_out()
        if self._pending is not None and self._pending.exception() is None:  # waits; never raises
            self._pending = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._executor is not None:
            self._finish()
            self._executor.shutdown()
            self._executor = None
