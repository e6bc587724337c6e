"""SD 2.x's `--to-diffusers` folder in diffusers' own `from_pretrained`, checked by outputs.

tests/ldm/test_diffusers_folder.py reads the SD 2.x folder back with our code (bit exact) and
tests/e2e/test_scripts.py draws SD 1.x's with diffusers; here diffusers' StableDiffusionPipeline
loads the folder of a tiny SD 2.x (OpenCLIP text tower as transformers' CLIPTextModel, stopped at
the penultimate block; v-prediction) and its UNet and text encoder, with its own tokenizer, give
our model's outputs (every base weight moved from its init, so nothing hides).
"""

import pytest
import torch
from lora_helpers import build, inputs, outputs_of_ours, outputs_of_pipeline, pipeline_of_base
from test_lora_sd2_text import tiny_v2_config  # noqa: F401 (fixture)

pytest.importorskip("diffusers")

V_PREDICTION = ("model.params.parameterization=v",)


def test_sd2_folder_loads_in_diffusers_with_our_outputs(tmp_path, tiny_v2_config):  # noqa: F811
    model = build(tiny_v2_config, None, overrides=V_PREDICTION).eval()
    config = tmp_path / "v2-v.yaml"
    config.write_text(
        tiny_v2_config.read_text().replace("parameterization: eps", "parameterization: v")
    )
    pipe = pipeline_of_base(model, config, tmp_path / "pipeline")
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.text_encoder.config.num_hidden_layers == 2  # 3 blocks, the last one unused
    x, t, context = inputs()
    theirs = outputs_of_pipeline(pipe, x, t, context)
    ours = outputs_of_ours(model, x, t, context)
    for got, expected in zip(theirs, ours):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
