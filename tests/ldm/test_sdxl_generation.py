"""SDXL generation: txt2img on a tiny SDXL (original sgm config + a file in the sgm layout), with
the size conditioning taken from --H / --W."""

import pytest
import torch
import txt2img
from omegaconf import OmegaConf
from PIL import Image
from sdxl_helpers import SIZE_DIM, TEXT_WIDTH, tiny_sdxl, tiny_sdxl_config

from ldm.checkpoint import save_safetensors

pytestmark = pytest.mark.slow


def test_txt2img_makes_sdxl_images_conditioned_on_their_size(tmp_path, monkeypatch):
    model = tiny_sdxl(seed=2)
    OmegaConf.save(tiny_sdxl_config(), tmp_path / "sdxl.yaml")
    save_safetensors(model.state_dict(), tmp_path / "sdxl.safetensors")

    seen = []
    conditioning = type(model).conditioning

    def recording(self, batch, *args, **kwargs):
        cond = conditioning(self, batch, *args, **kwargs)
        seen.append(cond["vector"][:, TEXT_WIDTH:].reshape(-1, 6, SIZE_DIM)[0, :, 0])
        return cond

    monkeypatch.setattr(type(model), "conditioning", recording)
    args = ["--config", str(tmp_path / "sdxl.yaml"), "--ckpt", str(tmp_path / "sdxl.safetensors")]
    args += ["--prompt", "a red circle", "--n_samples", "1", "--steps", "2", "--skip_grid"]
    txt2img.main([*args, "--H", "32", "--W", "48", "--outdir", str(tmp_path / "out")])
    (png,) = (tmp_path / "out" / "samples").glob("*.png")
    image = Image.open(png)
    assert image.size == (48, 32)
    assert "Size: 48x32" in image.text["parameters"]
    # cos(size * freq_0 = size): original = target = (32, 48), crop (0, 0), as diffusers' pipeline
    expected = torch.tensor([32.0, 48, 0, 0, 32, 48]).cos()
    torch.testing.assert_close(seen[0].cpu(), expected)
