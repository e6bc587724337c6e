"""Block swap's accelerator path (ldm.block_swap: a side stream copies each block in, the
compute stream waits for the copy's event) run on the CPU, its streams stand-ins that write
down what is asked of them - the machine has no device, and the order of these calls is what
keeps a device's streams from reading a block before its copy ends:

- the side stream waits for the compute stream before it copies (the block's memory, new to
  the compute stream's allocator, may have been another tensor's that kernels still read);
- every copy of a host tensor runs inside the side stream's context, and the event is recorded
  after the last one;
- the compute stream waits for that event before any layer of the block runs - in the forward,
  and in the backward's recomputation (reverse order, with prefetch) - and before the block's
  memory is freed (an eviction).
"""

import torch
from stream_helpers import Stream
from test_block_swap import step, tiny_dit, with_adapters
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ldm.block_swap import blocks_of, swap_blocks

SWAPPED = 4  # of the 5 blocks


class HostCopies(TorchDispatchMode):
    """Writes down each copy whose source is one of the swap's host tensors."""

    def __init__(self, swap, log):
        super().__init__()
        self.host = {id(t): i for i, block in enumerate(swap.host_tensors()) for t in block}
        self.swap, self.log = swap, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and id(args[1]) in self.host:
            self.log.append(("copy", self.host[id(args[1])]))
        return func(*args, **(kwargs or {}))


def test_each_block_is_copied_on_the_side_stream_and_waited_for_before_it_computes(
    monkeypatch,
):
    log = []
    compute, side = Stream("compute", log), Stream("side", log)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    model = with_adapters(tiny_dit())
    swap = swap_blocks(model, SWAPPED, torch.device("cpu"))
    swap.stream = side  # the accelerator path from here on
    blocks = blocks_of(model)[:SWAPPED]
    for index, block in enumerate(blocks):
        for layer in block.modules():
            if type(layer) is nn.Linear:
                layer.register_forward_pre_hook(lambda *_, i=index: log.append(("runs", i)))
    evict = swap._evict
    monkeypatch.setattr(swap, "_evict", lambda i: (evict(i), log.append(("evict", i))))
    with HostCopies(swap, log):
        for _ in range(2):  # training steps: forward, then the backward's recomputation
            step(model)
        for index in (0, 1, 2, 0):  # a forward cut short in block 2, and a new one: block 3,
            swap.load(index)  # prefetched, leaves before it ever ran

    event_of = {}  # block -> the event of its last copy, until the compute stream waited
    waited = set()
    state = "idle"  # side stream: idle -> waited (for compute) -> copying (entered) -> done
    copied = []  # the blocks whose copies ran in the current side-stream context
    for entry in log:
        what = entry[:2] if entry[0] in ("compute", "side") else entry[:1]  # who, what
        if what == ("side", "wait_stream"):
            assert entry[2] == "compute" and state == "idle"
            state = "waited"
        elif what == ("side", "enter"):
            assert state == "waited", "copies started before the side stream waited for compute"
            state, copied = "copying", []
        elif what == ("copy",):
            assert state == "copying", f"block {entry[1]} copied outside the side stream"
            copied.append(entry[1])
        elif what == ("side", "exit"):
            state = "done"
        elif what == ("side", "record"):
            assert state == "done" and len(set(copied)) == 1, "event not after the copies"
            event_of[copied[0]] = entry[2]
            state = "idle"
        elif what == ("compute", "wait_event"):
            waited.add(entry[2])
        elif what == ("runs",):
            index = entry[1]
            assert event_of[index] in waited, f"block {index} computed before its copy ended"
        elif what == ("evict",):
            index = entry[1]
            assert event_of[index] in waited, f"block {index} freed with its copy in flight"
    assert state == "idle"
    assert sorted(event_of) == list(range(SWAPPED))
    last_run = max(n for n, entry in enumerate(log) if entry[0] == "runs")
    assert ("evict", 3) in log[last_run:]  # the cut-short case ran
    # what ran, a block's consecutive layers as one: per step the forward 0..3, then the
    # backward's recomputation 3..0 (block 3's follows its forward at once; the next step
    # starts at block 0, where the backward ended)
    ran = [entry[1] for entry in log if entry[0] == "runs"]
    order = [i for n, i in enumerate(ran) if n == 0 or ran[n - 1] != i]
    assert order == [0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0], order
