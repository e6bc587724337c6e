"""`compile_backbone` on a CUDA machine, checked on the CPU: inductor's Triton kernels need a C
compiler at the first step (Triton builds its driver module with $CC, gcc or clang), so a
machine without one is one line at construction, not a failure inside `fit`."""

import pytest
import torch

from ldm.compile_options import compile_arguments


@pytest.fixture
def no_compilers(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no compiler on it
    for variable in ("CC", "CXX"):
        monkeypatch.delenv(variable, raising=False)


def test_inductor_on_cuda_without_a_c_compiler_is_one_line(monkeypatch, no_compilers):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA machine's answer
    with pytest.raises(ValueError, match=r"inductor on CUDA needs a compiler \(gcc, clang or \$CC"):
        compile_arguments(True)
    assert compile_arguments({"backend": "eager"}) == {"backend": "eager"}


def test_inductor_on_cuda_takes_the_c_compiler_cc_names(monkeypatch, no_compilers, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cc = tmp_path / "my-cc"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert compile_arguments({"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}


def test_inductor_on_the_cpu_without_a_cpp_compiler_is_one_line(monkeypatch, no_compilers):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"inductor on a CPU needs a compiler \(g\+\+"):
        compile_arguments(True)
