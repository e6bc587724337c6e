"""scripts/convert.py --half / --bf16: weights are halved, the DDPM schedule is not."""

import convert
import pytest
import torch
from safetensors import safe_open

from ldm.schedule import SCHEDULE_BUFFER_NAMES
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_config):
    """A Lightning-style .ckpt of the tiny model, with the EMA scalars the EMA callback writes."""
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    state = model.state_dict()
    state["model_ema.decay"] = torch.tensor(0.9999, dtype=torch.float32)
    state["model_ema.num_updates"] = torch.tensor(2, dtype=torch.int64)
    path = tmp_path_factory.mktemp("convert") / "tiny.ckpt"
    torch.save({"state_dict": state, "global_step": 2}, path)
    return path, state


@pytest.mark.parametrize("flag, dtype", [("--half", torch.float16), ("--bf16", torch.bfloat16)])
def test_half_keeps_schedule_buffers_float32(tmp_path, tiny_ckpt, flag, dtype):
    """fp16 rounds alphas_cumprod[0] 0.99915 -> 0.99902: samples drift from diffusers' 60x more."""
    ckpt, original = tiny_ckpt
    out = tmp_path / "model.safetensors"
    convert.main([str(ckpt), str(out), flag])
    with safe_open(str(out), framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}

    assert set(SCHEDULE_BUFFER_NAMES) <= set(written)
    for name in (*SCHEDULE_BUFFER_NAMES, "model_ema.decay"):
        assert written[name].dtype == torch.float32, name
        assert torch.equal(written[name], original[name]), name
    assert written["model_ema.num_updates"].dtype == torch.int64
    unet = {k: v for k, v in written.items() if k.startswith("model.diffusion_model.")}
    assert unet and all(v.dtype == dtype for v in unet.values())
    assert written["first_stage_model.decoder.conv_out.weight"].dtype == dtype


def test_half_ckpt_output_keeps_schedule_buffers_float32(tmp_path, tiny_ckpt):
    """The .ckpt writer follows the same rule as the .safetensors one."""
    ckpt, original = tiny_ckpt
    out = tmp_path / "model.ckpt"
    convert.main([str(ckpt), str(out), "--half"])
    written = torch.load(out, weights_only=True)["state_dict"]
    assert all(torch.equal(written[n], original[n]) for n in SCHEDULE_BUFFER_NAMES)
    assert all(written[n].dtype == torch.float32 for n in SCHEDULE_BUFFER_NAMES)
    assert written["model.diffusion_model.out.2.weight"].dtype == torch.float16
