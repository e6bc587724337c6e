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


# --- SD 3 / 3.5: to a diffusers folder diffusers itself loads, and back -------------------------

SD3_TINY = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "tiny.yaml"


@pytest.fixture(scope="module")
def sd3_ckpt(tmp_path_factory):
    """The tiny SD 3.5 with a tiny random T5 and shift 3.0 (the released configs'), every weight
    moved by seeded noise (adaLN-Zero would hide the blocks), as a .ckpt and its config."""
    from omegaconf import OmegaConf
    from sd3_helpers import T5_CONFIG, t5_tokenizer_folder

    root = tmp_path_factory.mktemp("sd3")
    cfg = OmegaConf.load(SD3_TINY)
    cfg.model.params.conditioner_config.params.t5xxl = {
        "tokenizer": str(t5_tokenizer_folder(root / "t5")),
        "config": {**T5_CONFIG, "vocab_size": 64},
    }
    cfg.model.params.schedule.shift = 3.0
    config = root / "sd3.yaml"
    OmegaConf.save(cfg, config)
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([config]))["model"])
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn_like(tensor))
    path = root / "sd3.ckpt"
    torch.save({"state_dict": model.state_dict(), "global_step": 2}, path)
    return path, config, model.eval()


@pytest.mark.slow  # writes a whole pipeline, loads it with diffusers, converts back: ~10 s alone
def test_sd3_diffusers_folder_loads_in_diffusers_and_converts_back_bit_exact(tmp_path, sd3_ckpt):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    ckpt, config, model = sd3_ckpt
    folder = tmp_path / "pipeline"
    convert.main([str(ckpt), "--to-diffusers", str(folder), "--config", str(config)])
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    assert pipe.text_encoder_3 is not None and pipe.tokenizer_3 is not None
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.scheduler.config.shift == 3.0

    prompts = ["a red cat", "a photo of a blue dog"]
    torch.manual_seed(1)
    x = torch.randn(2, 16, 8, 6)
    t = torch.tensor([150.0, 800.0])
    with torch.no_grad():  # diffusers' own text encoding, transformer and VAE against ours
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=12
        )
        cond = model.conditioner.condition({"caption": prompts})
        torch.testing.assert_close(cond["crossattn"], embeds, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cond["vector"], pooled, rtol=1e-5, atol=1e-5)
        theirs = pipe.transformer(
            x, encoder_hidden_states=embeds, pooled_projections=pooled, timestep=t
        ).sample
        ours = model.backbone(x, t, cond)
        assert ours.abs().mean() > 0.05  # a real signal
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        # the pipeline's decode: latents / scaling_factor + shift_factor
        latents = x[:1]
        image = pipe.vae.decode(
            latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        ).sample
        torch.testing.assert_close(model.decode_first_stage(latents), image, rtol=1e-4, atol=1e-4)

    back = tmp_path / "back.safetensors"
    convert.main([str(folder), str(back)])
    with safe_open(str(back), framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    original = model.state_dict()
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)


def test_sd3_checkpoint_with_another_familys_config_is_one_line(tmp_path, sd3_ckpt, capsys):
    ckpt, _, _ = sd3_ckpt
    sd1 = Path(__file__).resolve().parents[2] / "configs" / "stable-diffusion" / "v1-inference.yaml"
    with pytest.raises(SystemExit) as exit_info:
        convert.main([str(ckpt), "--to-diffusers", str(tmp_path / "out"), "--config", str(sd1)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SD 3" in err[0] and "SD 1.x" in err[0], err
    assert not (tmp_path / "out").exists()
