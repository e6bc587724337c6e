"""Our LoCon / DoRA files of SDXL in diffusers' own loader, checked weight by weight.

tests/ldm/test_lora_interop.py proves SD 1.x (LoRA, LoCon, DoRA) by outputs and
tests/e2e/test_sdxl_lora.py SDXL's attention LoRA by images; SDXL's LoCon groups (ResBlock convs,
time embedding, resamplers, under kohya's original SDXL names) and diffusers-format DoRA on SDXL
had no proof. (SD 2.x's UNet has SD 1.x's names, and the tiny SD 1.x already has its linear
proj_in; its OpenCLIP LoRA: tests/ldm/test_lora_sd2_text.py.) Here diffusers' `load_lora_weights`
puts our file on the pipeline of the base (our `--to-diffusers` export, diffusers' converters),
`fuse_lora` + `unload_lora_weights` fold it in, and every weight of the UNet and text encoders
must equal the export of our model after peft's own merge of its adapters. Random nonzero lora_B
and moved DoRA magnitudes.
"""

import copy
import logging
import re

import convert  # scripts/convert.py
import pytest
import torch
import yaml
from lora_helpers import build, randomize_adapters
from safetensors.torch import save_file
from sdxl_helpers import tiny_sdxl_config

from ldm import lora
from ldm.layout.peft import LORA_PREFIX
from lun.config import merge_configs, to_container

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow
LOCON = "rank: 2, alpha: 1, targets: [attn, proj, ff, conv], conv_rank: 3, conv_alpha: 6"
CASES = {
    "sdxl-locon-kohya": ("sdxl", f"{{{LOCON}, text_encoder: {{rank: 2, alpha: 4}}}}", "kohya"),
    "sdxl-locon-dora-diffusers": ("sdxl", f"{{{LOCON}, dora: true}}", "diffusers"),
}
COMPONENTS = ("unet", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuse") / "sdxl.yaml"
    path.write_text(yaml.safe_dump(tiny_sdxl_config()))
    return {"sdxl": path}


@pytest.fixture(scope="module")
def base_pipelines(tmp_path_factory, configs):
    """The pipeline of each family's base: `build` moves the base weights the same way whatever
    the adapters, so one export serves every case (each test takes a copy)."""
    root = tmp_path_factory.mktemp("base")
    return {
        family: pipeline(base_weights(build(config, None)), config, root / family)
        for family, config in configs.items()
    }


def pipeline(state: dict, config, folder):
    convert.export_diffusers(state, to_container(merge_configs([config])), folder)
    return diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)


def base_weights(model) -> dict:
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    return {k: v for k, v in saved["state_dict"].items() if not k.startswith(LORA_PREFIX)}


def weights(pipe) -> dict:
    found = {}
    for name in COMPONENTS:
        component = getattr(pipe, name, None)
        if component is not None:
            found.update({f"{name}.{k}": v.clone() for k, v in component.state_dict().items()})
    return found


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("case", sorted(CASES))
def test_diffusers_fuses_our_file_into_the_weights_of_peft_merge(
    tmp_path, configs, base_pipelines, case
):
    family, settings, kind = CASES[case]
    model = build(configs[family], settings).eval()
    randomize_adapters(model)
    merged = copy.deepcopy(model)
    lora.merge_adapters(merged)
    expected = weights(pipeline(merged.state_dict(), configs[family], tmp_path / "merged"))

    pipe = copy.deepcopy(base_pipelines[family])
    before = weights(pipe)
    state = lora.kohya_state_dict(model) if kind == "kohya" else lora.diffusers_state_dict(model)
    save_file(state, tmp_path / "adapter.safetensors")
    said = Said()
    logging.getLogger("diffusers").addHandler(said)
    try:
        pipe.load_lora_weights(tmp_path, weight_name="adapter.safetensors")
    finally:
        logging.getLogger("diffusers").removeHandler(said)
    # peft's "led to unexpected keys" / "missing keys" lines: a name diffusers could not place
    assert not [s for s in said.lines if re.search(r"(unexpected|missing) keys", s)], said.lines
    pipe.fuse_lora(components=[c for c in COMPONENTS if getattr(pipe, c, None) is not None])
    pipe.unload_lora_weights()
    got = weights(pipe)

    assert got.keys() == expected.keys()
    moved = [k for k in got if (expected[k] - before[k]).abs().max() > 1e-3]
    assert len(moved) >= len(lora.adapter_layers(model)), (len(moved), case)
    assert any(".resnets." in k and "conv1" in k for k in moved)  # the LoCon convs landed
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=3e-5, msg=key)
