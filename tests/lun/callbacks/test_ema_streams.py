"""The EMA's accelerator path with host shadows (lun.callbacks.ema: the weights copied to pinned
host buffers on a side stream, folded in on the host) run on the CPU, its streams and event
stand-ins that write down what is asked of them - the machine has no device, and the order of
these calls is what keeps the average right on one:

- the side stream waits for the compute stream (the optimizer step that made the weights)
  before it copies them, every copy inside its context, the event recorded after;
- the host waits for that event before the fold reads the staging buffers (a non-blocking
  device -> host copy has not landed when the call returns);
- the compute stream waits for it before the next optimizer step overwrites the weights.
"""

from types import SimpleNamespace

import torch
from stream_helpers import Stream
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lun.callbacks.ema import EMA


class StagingUse(TorchDispatchMode):
    """Writes down the ops that write or read the staging buffers."""

    def __init__(self, staging, log):
        super().__init__()
        self.staging, self.log = {id(t) for t in staging}, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        if any(id(t) in self.staging for t in tensors if isinstance(t, torch.Tensor)):
            self.log.append(("op", func.__name__))
        return func(*args, **(kwargs or {}))


def test_the_weights_copy_is_waited_for_by_the_fold_and_by_the_next_optimizer_step(
    monkeypatch,
):
    log = []
    compute, side = Stream("compute", log), Stream("side", log)
    monkeypatch.setattr(torch, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    torch.manual_seed(0)
    module = SimpleNamespace(ema_module=nn.Linear(3, 2), device=torch.device("cpu"))
    ema = EMA(decay=0.5, warmup="none", async_update=False)
    ema._allocate(module)
    before = {n: s.clone() for n, s in ema.shadows.items()}
    with torch.no_grad():
        for p in module.ema_module.parameters():  # the optimizer step's new weights
            p.add_(1.0)
    with ema._full_weights(module) as params, StagingUse(ema._staging.values(), log):
        ema._stage(params)  # what `_update` does on an accelerator with host shadows
        ema._fold_in(0.5, ema._copy_done)
    ema.on_before_optimizer_step(None, module, None)

    event = next(entry[2] for entry in log if entry[:2] == ("side", "record"))
    expected = [
        ("side", "wait_stream", "compute"),
        ("side", "enter"),
        ("op", "_foreach_copy_.default"),  # the weights into the staging buffers
        ("side", "exit"),
        ("side", "record", event),
        ("host", "synchronize", event),
        ("op", "_foreach_lerp_.Scalar"),  # the fold reads them
        ("compute", "wait_event", event),
    ]
    assert log == expected
    for name, p in module.ema_module.named_parameters():  # and the fold took the new weights
        torch.testing.assert_close(ema.shadows[name], (before[name] + p.detach()) / 2)
