"""EMA weights in our checkpoints, read by diffusers' own single-file converter.

The EMA callback writes each shadow as `model_ema.<backbone name without dots>` (CompVis LitEma's
rule, `ldm.layout.ema`). diffusers' `convert_ldm_unet_checkpoint(..., extract_ema=True)` finds a
UNet weight's shadow by that rule ("model_ema." + the key's parts after `model.`, joined) when the
file has more than 100 `model_ema` keys. Loaded so into the UNet of our `--to-diffusers` export, a
checkpoint the callback saved must give the output of our model holding the EMA weights - shadows
moved away from the raw weights, so reading the raw ones instead shows.
"""

import pytest
import torch
from lora_helpers import build, inputs, pipeline_of_base

from lun.callbacks.ema import EMA

diffusers = pytest.importorskip("diffusers")


def test_diffusers_extract_ema_reads_the_shadows_our_callback_saves(tmp_path, tiny_config):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    model = build(tiny_config, None).eval()
    pipe = pipeline_of_base(model, tiny_config, tmp_path / "pipeline")
    ema = EMA()
    ema._allocate(model)  # shadows = the weights, as at the start of a run
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for shadow in ema.shadows.values():
            shadow.add_(0.05 * torch.randn(shadow.shape, generator=generator))
    checkpoint = {"state_dict": dict(model.state_dict())}
    ema.on_save_checkpoint(None, model, checkpoint)
    torch.save(checkpoint, tmp_path / "last.ckpt")

    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    assert sum(k.startswith("model_ema") for k in state) > 100  # diffusers' threshold
    unet = convert_ldm_unet_checkpoint(state, pipe.unet.config, extract_ema=True)
    assert all(v is not None for v in unet.values()), [k for k, v in unet.items() if v is None][:3]
    pipe.unet.load_state_dict(unet, strict=True)

    x, t, context = inputs()
    with torch.no_grad():
        raw = model.apply_model(x, t, {"crossattn": context})
        for name, shadow in ema.shadows.items():
            model.model.get_parameter(name).copy_(shadow)
        ours = model.apply_model(x, t, {"crossattn": context})
        theirs = pipe.unet(x, t, encoder_hidden_states=context).sample
    assert (ours - raw).abs().max() > 1e-2  # the EMA weights differ from the raw ones
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
