import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm.unet import UNetModel

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"
PREFIX = "model.diffusion_model."


@pytest.mark.parametrize("config, reference", [("v1-inference.yaml", "sd_v1_keys.json"),
                                               ("v2-inference.yaml", "sd_v2_base_keys.json")])
def test_full_size_unet_has_the_original_keys_and_shapes(config, reference):
    params = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "stable-diffusion" / config)).get("model")
    with torch.device("meta"):
        unet = UNetModel(**params["params"]["unet_config"]["params"])
    ours = {PREFIX + k: list(v.shape) for k, v in unet.state_dict().items()}
    expected = {k: v for k, v in json.loads((REFERENCE / reference).read_text())["keys"].items() if k.startswith(PREFIX)}
    assert ours == expected


SMALL = {"in_channels": 4, "out_channels": 4, "model_channels": 32, "attention_resolutions": [1, 2],
         "num_res_blocks": 1, "channel_mult": [1, 2], "transformer_depth": 1, "context_dim": 32}
V1 = {**SMALL, "num_heads": 4}
V2 = {**SMALL, "num_head_channels": 16, "use_linear_in_transformer": True}


def diffusers_twin(params: dict, unet: UNetModel):
    """diffusers' UNet2DConditionModel with our weights, converted by diffusers' own converter."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, create_unet_diffusers_config_from_ldm

    state = {PREFIX + k: v for k, v in unet.state_dict().items()}
    vae = {"params": {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}}  # the converter reads the VAE's factor
    original = {"model": {"params": {"unet_config": {"params": params}, "first_stage_config": vae}}}
    config = create_unet_diffusers_config_from_ldm(original, state)
    twin = UNet2DConditionModel(**config)
    twin.load_state_dict(convert_ldm_unet_checkpoint(state, config))
    return twin.eval()


def random_inputs(batch=2, side=16, context_len=7):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 4, side, side, generator=g), torch.tensor([3, 917])[:batch],
            torch.randn(batch, context_len, 32, generator=g))


@pytest.mark.parametrize("params", [V1, V2], ids=["v1", "v2"])
def test_same_outputs_as_diffusers(params):
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = UNetModel(**params).eval()
    for p in unet.parameters():
        if p.abs().sum() == 0:  # zero-initialised output layers would hide differences
            torch.nn.init.normal_(p, std=0.05)
    twin = diffusers_twin(params, unet)
    x, t, context = random_inputs()
    with torch.no_grad():
        ours = unet(x, t, context=context)
        theirs = twin(x, t, encoder_hidden_states=context).sample
    assert ours.shape == x.shape and ours.abs().mean() > 1e-3
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = UNetModel(**V2).train()
    checkpointed = UNetModel(**{**V2, "use_checkpoint": True}).train()
    checkpointed.load_state_dict(plain.state_dict())
    x, t, context = random_inputs()
    grads = []
    for model in (plain, checkpointed):
        model(x, t, context=context).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_upcast_attention_matches_in_fp32_and_xformers_absence_is_named(monkeypatch):
    torch.manual_seed(0)
    plain = UNetModel(**V1).eval()
    upcast = UNetModel(**{**V1, "upcast_attention": True}).eval()
    upcast.load_state_dict(plain.state_dict())
    x, t, context = random_inputs()
    with torch.no_grad():
        torch.testing.assert_close(plain(x, t, context=context), upcast(x, t, context=context))
    import sys

    monkeypatch.setitem(sys.modules, "xformers", None)
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with pytest.raises(ImportError, match="pip install xformers"):
        model = UNetModel(**{**V1, "attention_backend": "xformers"}).eval()
        with torch.no_grad():
            model(x, t, context=context)
