"""Flux.1 dev end to end: configs/flux/tiny.yaml (tiny random T5 with a local tokenizer folder,
tiny CLIP-L) trains 2 steps through main.py, and txt2img samples the checkpoint with the flow
Euler sampler, the dev guidance scale going into the backbone's guidance input."""

import pytest
import txt2img
from PIL import Image
from run_helpers import ROOT, run_main
from sd3_helpers import t5_tokenizer_folder

from ldm.layout import family
from lun.strategies import load_training_checkpoint

TINY = ROOT / "configs" / "flux" / "tiny.yaml"


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, shapes_dir):
    logs = tmp_path_factory.mktemp("flux_logs")
    tokenizer = t5_tokenizer_folder(tmp_path_factory.mktemp("t5_tokenizer"))
    args = [
        *("--base", str(TINY), f"data.params.train.params.data_root={shapes_dir}"),
        f"model.params.conditioner_config.params.t5xxl.tokenizer={tokenizer}",
        "lightning.trainer.max_steps=2",
        *("-l", str(logs), "-t"),
    ]
    result = run_main(args, cwd=logs)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = logs.iterdir()
    return run


@pytest.mark.slow
def test_tiny_flux_trains_two_steps_into_bfl_names(flux_run):
    trained = load_training_checkpoint(flux_run / "checkpoints" / "last.ckpt")
    assert trained["global_step"] == 2
    state = trained["state_dict"]
    assert family.model_family(state) == family.FLUX
    assert "model.diffusion_model.guidance_in.in_layer.weight" in state  # dev
    for encoder in ("clip_l", "t5xxl"):
        assert any(k.startswith(f"text_encoders.{encoder}.transformer.") for k in state), encoder
    # trained: the zero-initialised output layer (adaLN-Zero) moved
    assert state["model.diffusion_model.final_layer.linear.weight"].abs().sum() > 0


def generate(run, out, *extra):
    txt2img.main(
        [
            *("--ckpt", str(run / "checkpoints" / "last.ckpt"), "--outdir", str(out)),
            *("--sampler", "euler", "--steps", "3", "--prompt", "a red circle"),
            *("--n_samples", "1", "--seed", "7", "--skip_grid", *extra),
        ]
    )
    return sorted((out / "samples").glob("*.png"))


@pytest.mark.slow
def test_txt2img_samples_the_flux_checkpoint_with_dev_guidance(flux_run, tmp_path):
    first = generate(flux_run, tmp_path / "a", "--scale", "1")
    assert len(first) == 1 and Image.open(first[0]).size == (32, 32)
    again = generate(flux_run, tmp_path / "b", "--scale", "1")
    assert again[0].read_bytes() == first[0].read_bytes()  # seeded
    guided = generate(flux_run, tmp_path / "c", "--scale", "3")
    assert guided[0].read_bytes() != first[0].read_bytes()  # CFG reads the "" side too
