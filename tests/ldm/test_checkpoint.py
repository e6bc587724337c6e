import os
import pickle

import numpy as np
import pytest
import torch

from ldm import checkpoint
from ldm.layout.ema import ema_key
from ldm.layout.original import CLIP_PREFIX
from ldm.safe_load import UnsafeCheckpointError
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


@pytest.fixture(scope="module")
def model(tiny_config):
    torch.manual_seed(0)
    return instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])


class Exploit:
    """What a malicious checkpoint carries: an object whose unpickling runs a command."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_code_is_refused_unless_unsafe(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "payload": Exploit()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system|--unsafe-load"):
        checkpoint.load_file_state(path)
    safe_class = tmp_path / "class.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "obj": pickle.PickleError("x")}, safe_class)
    with pytest.raises(UnsafeCheckpointError, match="PickleError"):
        checkpoint.load_file_state(safe_class)
    assert "obj" in checkpoint.load_file_state(safe_class, unsafe=True)


def test_original_checkpoint_bookkeeping_loads_safely(tmp_path):
    """Released SD .ckpt files pickle the ModelCheckpoint class (as a dict key) and numpy scalars."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    path = tmp_path / "sd.ckpt"
    contents = {
        "state_dict": {"w": torch.arange(3.0)},
        "global_step": 470000,
        "epoch": np.int64(5),
        "callbacks": {ModelCheckpoint: {"best_model_score": np.float64(0.1)}},
    }
    torch.save(contents, path)
    loaded = checkpoint.load_file_state(path)
    assert torch.equal(checkpoint.state_dict_of(loaded)["w"], torch.arange(3.0))
    assert loaded["global_step"] == 470000


def test_safetensors_round_trip_is_exact(tmp_path, model):
    state = model.state_dict()
    path = tmp_path / "model.safetensors"
    checkpoint.save_safetensors(state, path)
    loaded = checkpoint.load_file_state(path)
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    half = tmp_path / "half.safetensors"
    checkpoint.save_safetensors(state, half, dtype=torch.float16)
    assert checkpoint.load_file_state(half)["betas"].dtype == torch.float16


def test_state_dict_is_the_original_layout_and_both_clip_forms_load(model):
    state = model.state_dict()
    clip = [k for k in state if k.startswith(CLIP_PREFIX)]
    assert clip and all(k.startswith(CLIP_PREFIX + "text_model.") for k in clip)
    # An old checkpoint: with position_ids.
    old = {
        **state,
        CLIP_PREFIX + "text_model.embeddings.position_ids": torch.arange(77)[None],
    }
    model.load_state_dict(old, strict=True)
    # A checkpoint written by a library without the `text_model.` level.
    new = {k.replace("transformer.text_model.", "transformer."): v for k, v in state.items()}
    model.load_state_dict(new, strict=True)


def test_ema_weights_load_onto_the_unet(tmp_path, model):
    state = model.state_dict()
    names = [n for n, _ in model.model.named_parameters()]
    ema = {ema_key(n): torch.full_like(p, 0.5) for n, p in model.model.named_parameters()}
    assert (
        ema_key("diffusion_model.input_blocks.0.0.weight")
        == "model_ema.diffusion_modelinput_blocks00weight"
    )
    path = tmp_path / "full-ema.safetensors"
    checkpoint.save_safetensors(
        {
            **state,
            **ema,
            "model_ema.decay": torch.tensor(0.9999),
            "model_ema.num_updates": torch.tensor(7, dtype=torch.int32),
        },
        path,
    )
    checkpoint.load_weights(model, path, ema=False)
    assert torch.equal(
        model.model.diffusion_model.out[2].weight, state["model.diffusion_model.out.2.weight"]
    )
    checkpoint.load_weights(model, path, ema=True)
    assert all((p == 0.5).all() for p in model.model.parameters())
    assert len(names) == len(ema)
    plain = tmp_path / "plain.safetensors"
    checkpoint.save_safetensors(state, plain)
    with pytest.raises(KeyError, match="has none"):
        checkpoint.load_weights(model, plain, ema=True)
    model.load_state_dict(state)


def test_mismatched_checkpoint_names_the_first_keys(tmp_path, model):
    state = model.state_dict()
    state.pop("model.diffusion_model.out.2.weight")
    state["model.diffusion_model.extra.weight"] = torch.ones(1)
    path = tmp_path / "other.safetensors"
    checkpoint.save_safetensors(state, path)
    with pytest.raises(
        KeyError, match=r"missing keys, first: model\.diffusion_model\.out\.2\.weight.*unexpected"
    ):
        checkpoint.load_weights(model, path)
