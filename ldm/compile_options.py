"""`compile_backbone` (`compile_unet`) checked before the run: `torch.compile` fails lazily, at
the first step inside `fit`, after the run folder exists; here a machine where it cannot run or
an argument it does not take is one line naming the option."""

import inspect
import os
import shutil
from collections.abc import Mapping

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_arguments(value) -> dict:
    """`compile_backbone` (true or a dict of `torch.compile` arguments) -> those arguments, or
    one error line naming the option where torch.compile cannot run or an argument is wrong."""
    import torch._dynamo

    options = {} if value is True else value
    if not isinstance(options, Mapping):
        raise ValueError(f"compile_backbone: expected true, false or a mapping, got {value!r}")
    if not torch._dynamo.is_dynamo_supported():
        raise ValueError(
            "compile_backbone: torch.compile cannot run with this Python/PyTorch; set it to false"
        )
    unknown = set(options) - set(inspect.signature(torch.compile).parameters) - {"model"}
    if unknown:
        raise ValueError(f"compile_backbone.{sorted(unknown)[0]}: not a torch.compile argument")
    if options.get("mode") not in COMPILE_MODES:
        raise ValueError(
            f"compile_backbone.mode: {options['mode']!r} is not one of {COMPILE_MODES[1:]}"
        )
    backend = options.get("backend", "inductor")
    if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile_backbone.backend: {backend!r} is not a torch.compile backend")
    if backend == "inductor":
        # Its CPU kernels are C++; on CUDA, Triton builds its driver and launchers with a C
        # compiler at the first kernel (triton/runtime/build.py: $CC, else gcc, else clang).
        where, names = (
            ("CUDA", ("CC", "gcc", "clang"))
            if torch.cuda.is_available()
            else ("a CPU", ("CXX", "g++", "c++", "clang++"))
        )
        if not _compiler(*names):
            raise ValueError(
                f"compile_backbone: inductor on {where} needs a compiler ({', '.join(names[1:])} "
                f"or ${names[0]}) and none is on PATH; install one, set backend: eager, or set "
                "compile_backbone: false"
            )
    return dict(options)


def _compiler(variable: str, *names: str) -> str | None:
    """The compiler `$variable` names, else the first of `names` on PATH."""
    candidates = (os.environ.get(variable), *names)
    return next((path for name in candidates if name and (path := shutil.which(name))), None)
