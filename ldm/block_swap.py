"""Block swap: the frozen weights of some of the backbone's blocks kept in host RAM and streamed
to the compute device ahead of use, for a base that does not fit the device even quantized.

Each swapped block holds its frozen parameters and buffers in (pinned, on an accelerator) host
memory; on the device at most `resident` of them are present at once: the block computing and
the next one, copied in ahead on a side stream while the current one computes (the approach of
musubi-tuner's and OneTrainer's block swap). Trainable tensors (the adapters) never move. A
block that left the device holds empty placeholders, so running it without loading it fails
loudly instead of computing with stale weights.

The backward pass needs the weights again (the gradient of a block's input is W^T times the
output's), so a swapped block runs under activation checkpointing (Chen et al. 2016,
arXiv:1604.06174): its forward saves nothing, and the backward recomputes it - loading the block
again, in reverse order, with the block before it prefetched.

Block swap lasts one fit: `unswap_blocks` (the LoRA mode's `on_fit_end`) gives every swapped block
its host copies back as its own tensors and removes the wrappers and hooks, so that the model
computes in the same process afterwards (sampling, a second fit, which swaps again).
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# A swapped module's attribute: its frozen tensors' host copies by name (`host_copy`)
HOST_COPIES = "block_swap_host_copies"
# Swapped blocks on the device at once: the one computing and the next one, copied in ahead
RESIDENT = 2


def host_copy(module: nn.Module, name: str) -> torch.Tensor | None:
    """The host copy of `module`'s tensor `name` when block swap holds it (whatever is on the
    device right now: off the device, the module holds an empty placeholder), else None."""
    return module.__dict__.get(HOST_COPIES, {}).get(name)


def blocks_of(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's blocks in the order they run, as the backbone itself names them
    (`blocks_in_order()`: the UNet's input, middle and output blocks, DiT / MMDiT's blocks,
    Flux's double then single blocks): what `base_quantization` quantizes and `blocks_to_swap`
    streams. The embedders and the output layer are not blocks (they stay as they are).
    `backbone` may be a wrapper of it (LatentDiffusion's `model.diffusion_model`): the outermost
    module that names its blocks answers."""
    named = next(
        (m.blocks_in_order for m in backbone.modules() if hasattr(m, "blocks_in_order")), None
    )
    if named is None:
        inner = backbone
        while len(children := list(inner.children())) == 1:  # the wrapped one, for its name
            inner = children[0]
        raise ValueError(
            f"model.params.lora: the backbone {type(inner).__name__} does not name its blocks "
            "(a `blocks_in_order()` method), so base_quantization / blocks_to_swap cannot act "
            "on it; set both to their defaults"
        )
    return list(named())


class BlockSwap:
    """Streams `blocks` (in their running order) between host RAM and `device`, keeping at most
    `resident` of them there (2: the one computing and the one prefetched)."""

    def __init__(self, blocks: list[nn.Module], device: torch.device, resident: int = RESIDENT):
        if resident < 1:
            raise ValueError("block swap: at least one block must fit on the device")
        self.blocks, self.device, self.resident = blocks, torch.device(device), resident
        self.pin = accelerator = self.device.type != "cpu"
        # Side stream for the copies, so that they overlap the compute (no streams on the CPU:
        # the same code path runs as plain copies).
        self.stream = torch.Stream(device=self.device) if accelerator else None
        self.loaded: list[int] = []  # blocks on the device, oldest first
        # Blocks whose copy the compute stream has not waited for yet -> the copy's event (None
        # on the CPU, where copies are done when they return)
        self.copying: dict[int, object] = {}
        self.last: int | None = None
        self.host = []  # per block: [(module, name, is_parameter, host tensor)]
        self.handles = []  # the blocks' state-dict hooks (`swap_blocks`), removed by `unswap`
        self.own_forwards = []  # per block: a forward it held itself before the wrapper, or None
        for index, block in enumerate(blocks):
            tensors = [
                (module, name, is_parameter, self._to_host(t.data, accelerator))
                for module, name, is_parameter, t in _frozen_named(block)
            ]
            self.host.append(tensors)
            for module, name, _, host in tensors:  # for readers of the stored weights
                module.__dict__.setdefault(HOST_COPIES, {})[name] = host
            # The block's own tensors go now, not once all blocks are copied: on an accelerator
            # pinning copies them, and host memory would peak at twice the swapped weights.
            self._set(index, None)

    @staticmethod
    def _to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        host = tensor.detach().to("cpu")  # on the CPU already: the same storage, no copy
        return host.pin_memory() if pin else host  # pinned: copies can run asynchronously

    def host_tensors(self) -> list[list[torch.Tensor]]:
        """Per swapped block, in running order, the host copies of its frozen tensors: what the
        swap holds in host RAM and copies to the device when the block runs."""
        return [[host for *_, host in tensors] for tensors in self.host]

    def _set(self, index: int, tensors: list[torch.Tensor] | None) -> None:
        """Point block `index`'s tensors at `tensors` (on the device), or at empty placeholders
        (in the dtype the module holds each one in now)."""
        for i, (module, name, is_parameter, _) in enumerate(self.host[index]):
            if tensors is not None:
                value = tensors[i]
            else:
                current = module._parameters[name] if is_parameter else module._buffers[name]
                value = torch.empty(0, dtype=current.dtype, device=self.device)
            if is_parameter:
                module._parameters[name].data = value
            else:
                module._buffers[name] = value

    def _fetch(self, index: int) -> None:
        """Start copying block `index` to the device, making room first (oldest out)."""
        if index in self.loaded or not 0 <= index < len(self.blocks):
            return
        while len(self.loaded) >= self.resident:
            self._evict(self.loaded[0])
        # Allocated on the compute stream (so freed there safely), filled on the side stream
        # once the compute stream's earlier work is done.
        self._follow_dtypes(index)
        tensors = [torch.empty_like(h, device=self.device) for *_, h in self.host[index]]
        event = None
        if self.stream is None:
            for tensor, (*_, host) in zip(tensors, self.host[index]):
                tensor.copy_(host)
        else:
            self.stream.wait_stream(torch.accelerator.current_stream(self.device))
            with self.stream:
                for tensor, (*_, host) in zip(tensors, self.host[index]):
                    tensor.copy_(host, non_blocking=True)
            event = self.stream.record_event()
        self.copying[index] = event
        self._set(index, tensors)
        self.loaded.append(index)

    def _follow_dtypes(self, index: int) -> None:
        """A module-wide `.to(dtype)` after the swap - Lightning's true precision converts the
        model after the `setup` hook - reaches the placeholders only: the host copies follow
        them (once), as the module's own tensors would have been converted."""
        for i, (module, name, is_parameter, host) in enumerate(self.host[index]):
            current = module._parameters[name] if is_parameter else module._buffers[name]
            if current.dtype != host.dtype:
                converted = self._to_host(host.to(current.dtype), self.pin)
                module.__dict__[HOST_COPIES][name] = converted
                self.host[index][i] = (module, name, is_parameter, converted)

    def _wait_for_copy(self, index: int) -> None:
        """Make the compute stream wait (on the device, not the host) until block `index`'s copy
        is done; once per copy."""
        event = self.copying.pop(index, None)
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    def _evict(self, index: int) -> None:
        """Block `index` off the device: its weights are frozen, so the host copy is current."""
        # A prefetched block may leave before it ever ran (the loads went another way), its copy
        # still in flight on the side stream. Its tensors belong to the compute stream, and the
        # caching allocator gives memory freed there to that stream's next allocation at once: it
        # is "aware of only the stream where a tensor was allocated" (torch docs,
        # `Tensor.record_stream`); a use on another stream needs that stream's work waited for
        # before the free (an event, as here) or record_stream. Without the wait, the compute
        # stream's next tensors could be overwritten by the copy still running.
        self._wait_for_copy(index)
        self._set(index, None)
        self.loaded.remove(index)

    def load(self, index: int) -> None:
        """Block `index` on the device, ready for the compute stream, and its successor in the
        running direction (forward: the next block; the backward's recompute: the previous one)
        on its way."""
        step = -1 if self.last is not None and index < self.last else 1
        if index in (0, len(self.blocks) - 1):  # at an end, the only way is inward
            step = 1 if index == 0 else -1
        self.last = index
        if index in self.loaded:  # prefetched: now the most recent
            self.loaded.remove(index)
            self.loaded.append(index)
        else:
            self._fetch(index)
        self._wait_for_copy(index)
        if self.resident > 1:
            self._fetch(index + step)

    def state_dict_hook(self, index: int):
        """A block's state dict from the host copies (whatever is on the device right now)."""

        def hook(module, state, prefix, local_metadata):
            for owner, name, _, host in self.host[index]:
                path = _path(module, owner)
                key = prefix + (path + "." if path else "") + name
                if key in state:
                    state[key] = host
            return state

        return hook

    def load_hook(self, index: int):
        """Loading a state dict into a swapped block fills the host copies."""

        def hook(module, state, prefix, *args):
            for owner, name, is_parameter, host in self.host[index]:
                path = _path(module, owner)
                key = prefix + (path + "." if path else "") + name
                if key in state and state[key].shape == host.shape:
                    host.copy_(state[key])
                    current = owner._parameters[name] if is_parameter else owner._buffers[name]
                    state[key] = current.detach()  # the load copies it onto itself

        return hook

    def loaded_hook(self, index: int):
        """After a state dict's load (into the host copies, `load_hook`, and bitsandbytes' int8
        `SCB` into the host copy of the scales, `ldm.quantize.int8_scales`): a block on the
        device now takes the loaded values too, not only once it is loaded again."""

        def hook(module, incompatible_keys):
            if index in self.loaded:
                self._wait_for_copy(index)  # the copy in flight would overwrite them
                for owner, name, is_parameter, host in self.host[index]:
                    current = owner._parameters[name] if is_parameter else owner._buffers[name]
                    with torch.no_grad():
                        current.copy_(host)

        return hook

    def unswap(self) -> None:
        """Every block's frozen tensors are its host copies again, as ordinary tensors of its
        modules: nothing left on the device, no placeholders, no host-copy entries (so that
        `host_copy` / `ldm.quantize.stored` read the module's own tensors)."""
        for index in list(self.loaded):  # waits for a copy still in flight before its free
            self._evict(index)
        for index, tensors in enumerate(self.host):
            self._follow_dtypes(index)  # a `.to(dtype)` since the block last loaded
            for module, name, is_parameter, host in tensors:
                if is_parameter:
                    module._parameters[name].data = host
                else:
                    module._buffers[name] = host
                module.__dict__.pop(HOST_COPIES, None)
        for handle in self.handles:
            handle.remove()
        for block, own in zip(self.blocks, self.own_forwards):
            if own is None:
                del block.forward  # the wrapper (an instance attribute): the class's forward
            else:
                block.forward = own
        self.host, self.handles, self.own_forwards, self.copying = [], [], [], {}


def _path(root: nn.Module, module: nn.Module) -> str:
    for name, found in root.named_modules():
        if found is module:
            return name
    raise KeyError("module not in the block")


def _swapped_forward(swap: BlockSwap, index: int, forward):
    def run(*args, **kwargs):
        swap.load(index)
        return forward(*args, **kwargs)

    def swapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        # Nothing of the block is saved for the backward: it recomputes (and reloads) it.
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return swapped


def _frozen_named(block: nn.Module):
    """(module, name, is_parameter, tensor) of each tensor a swap moves to host RAM: the block's
    frozen parameters and its buffers (the adapters train on the device). bitsandbytes' nf4
    state is an attribute of the weight, not a tensor of the module: it stays where it is."""
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                yield module, name, True, p
        for name, b in module.named_buffers(recurse=False):
            if b is not None:
                yield module, name, False, b


def frozen_tensors(block: nn.Module) -> list[torch.Tensor]:
    """The tensors of `block` that a swap would hold in host RAM (see `_frozen_named`)."""
    return [t for *_, t in _frozen_named(block)]


def swaps_in(module: nn.Module) -> list[BlockSwap]:
    """The block swaps active in `module` (a backbone's, wherever it sits in the model)."""
    return [m.__dict__["block_swap"] for m in module.modules() if "block_swap" in m.__dict__]


def check_swap_count(backbone: nn.Module, count: int) -> list[nn.Module]:
    """The backbone's blocks, when `count` of them can be swapped (ValueError naming
    `blocks_to_swap` when not): checked when the model is built, and again when it swaps."""
    blocks = blocks_of(backbone)
    if count > len(blocks):
        raise ValueError(
            f"model.params.lora.blocks_to_swap: {count} is more than the backbone's "
            f"{len(blocks)} blocks"
        )
    return blocks


def swap_blocks(
    backbone: nn.Module, count: int, device: torch.device, resident: int = RESIDENT
) -> BlockSwap:
    """Keep the first `count` blocks of `backbone` in host RAM, streamed to `device` when they
    run. Call before the model moves to the device (Lightning's `setup`)."""
    unswap_blocks(backbone)  # a swap left by a fit that did not end through its hooks
    blocks = check_swap_count(backbone, count)
    swap = BlockSwap(blocks[:count], device, resident)
    for index, block in enumerate(blocks[:count]):
        swap.own_forwards.append(block.__dict__.get("forward"))
        block.forward = _swapped_forward(swap, index, block.forward)
        swap.handles += [
            block._register_state_dict_hook(swap.state_dict_hook(index)),
            block._register_load_state_dict_pre_hook(swap.load_hook(index), with_module=True),
            block.register_load_state_dict_post_hook(swap.loaded_hook(index)),
        ]
    backbone.block_swap = swap  # a plain attribute: not a module, not in the state dict
    return swap


def unswap_blocks(backbone: nn.Module) -> bool:
    """Undo `swap_blocks` on `backbone` (see `BlockSwap.unswap`); whether it was swapped."""
    swap = backbone.__dict__.pop("block_swap", None)
    if swap is None:
        return False
    swap.unswap()
    return True
