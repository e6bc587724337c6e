"""scripts/convert.py --half / --bf16: weights are halved, the DDPM schedule is not."""

from pathlib import Path

import convert
import pytest
import torch
from safetensors import safe_open

from ldm import checkpoint
from ldm.schedule import SCHEDULE_BUFFER_NAMES
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.memory_probe import peak_allocated
from lun.strategies import load_training_checkpoint


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


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (Linux)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(" " + str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_converting_holds_one_tensor_at_a_time(tmp_path, tiny_ckpt):
    """The checkpoint is memory-mapped (its tensors are read from the file when written) and
    each tensor is cast and written alone: a full-size checkpoint converts in little more
    memory than its largest tensor."""
    ckpt, original = tiny_ckpt
    contents = load_training_checkpoint(ckpt, mmap=True)
    mapped = file_mappings(ckpt.resolve())
    for key, tensor in checkpoint.state_dict_of(contents).items():
        assert any(start <= tensor.data_ptr() < end for start, end in mapped), key

    out = tmp_path / "model.safetensors"
    state = convert.convert_state(checkpoint.state_dict_of(contents), ema=False, prune=False)

    def write():
        convert.save_checkpoint_file(state, out, torch.float16, contents, prune=False)

    largest = max(v.numel() * v.element_size() for v in original.values())
    assert peak_allocated(write, torch.device("cpu")) < 0.6 * largest  # the largest, cast to fp16
    with safe_open(str(out), framework="pt") as f:
        assert set(f.keys()) == set(original)
        for key in f.keys():
            expected = convert.cast_weights({key: original[key]}, torch.float16)[key]
            assert torch.equal(f.get_tensor(key), expected), key
