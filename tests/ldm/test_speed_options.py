"""The model-step speed options (docs/gpu.md): `attention_kernels`, `compile_backbone`
(`compile_unet`) and `channels_last` change how the step runs, never what it computes; one the
machine cannot run is one config line naming it (exit 2, no run folder)."""

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT, run_main_here
from torch.profiler import ProfilerActivity, profile
from torch.testing import assert_close

from ldm.util import instantiate_from_config

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"
CUDA = torch.cuda.is_available()


def tiny_model(**params):
    config = OmegaConf.to_container(OmegaConf.load(TINY)["model"])
    config["params"].update(params)
    torch.manual_seed(0)
    return instantiate_from_config(config)


def model_inputs(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, model.latent_channels, 8, 8, generator=g)
    t = torch.tensor([10, 900])
    cond = model.conditioning({"caption": ["a red circle", "a blue square"]})
    return x, t, cond


def aten_ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def test_attention_kernels_pick_the_kernel_and_keep_the_output():
    plain, math = tiny_model(), tiny_model(attention_kernels="math")
    x, t, cond = model_inputs(plain)
    with torch.no_grad():
        expected = plain.apply_model(x, t, cond)
        ops = aten_ops(lambda: math.apply_model(x, t, cond))
        got = math.apply_model(x, t, cond)
    # PyTorch's reference kernel (softmax(q k^T / sqrt d) v written out) ran, not a fused one.
    assert "aten::_scaled_dot_product_attention_math" in ops
    assert not any("flash" in op or "efficient" in op for op in ops)
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_kernels_name_every_bad_value():
    for value, words in (("fast", "'fast' is not one of"), ([], "empty")):
        with pytest.raises(ValueError, match=f"attention_kernels: {words}"):
            tiny_model(attention_kernels=value)


@pytest.mark.skipif(CUDA, reason="the case is a machine without CUDA")
@pytest.mark.parametrize(
    "override, words",
    [
        ("model.params.attention_kernels=cudnn", "attention_kernels: 'cudnn' cannot run"),
        ("model.params.compile_backbone={mode: fastest}", "compile_backbone.mode: 'fastest'"),
        # the old spelling, as CompVis configs write it
        ("model.params.compile_unet={backend: nope}", "compile_backbone.backend: 'nope'"),
    ],
    ids=["cudnn-on-cpu", "compile-mode", "compile-backend"],
)
def test_an_option_this_machine_cannot_run_is_one_line(tmp_path, shapes_dir, override, words):
    args = ["--base", TINY, f"data.params.train.params.data_root={shapes_dir}", override]
    result = run_main_here([*args, "-l", tmp_path / "logs", "-t"], tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("INFO")]
    assert len(errors) == 1 and errors[0].startswith("config error: model"), result.stderr
    assert words in errors[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow  # dynamo tracing of forward and backward: ~20 s on 2 cores
def test_compiled_channels_last_backbone_computes_what_eager_does():
    # aot_eager traces forward and backward into graphs (AOTAutograd) as inductor does, without
    # inductor's C++ build (minutes on 2 cores); the option plumbing is the same.
    eager = tiny_model()
    fast = tiny_model(channels_last=True, compile_unet={"backend": "aot_eager"})
    x, t, cond = model_inputs(eager)
    outputs, grads = [], []
    for model in (eager, fast):
        out = model.apply_model(x, t, {k: v.detach() for k, v in cond.items()})
        out.square().mean().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad for n, p in model.model.named_parameters() if p.grad is not None})
    assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, rtol=1e-3, atol=1e-5, msg=name)
