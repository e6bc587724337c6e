"""A run's saved project config works alone wherever a config is taken (issue 29 item 3): the
CompVis way, `txt2img.py --ckpt logs/<run>/checkpoints/last.ckpt --config
logs/<run>/configs/<time>-project.yaml`, and img2img, convert, evaluate and `--base` of a new
run - although the project's `total_steps: ${lightning.trainer.max_steps}` points into the
lightning section, which is saved in the other file. The interpolation itself stays as written
(a `--resume` with a larger max_steps moves it: tests/e2e/test_lora_resume.py)."""

import convert
import img2img
import pytest
import txt2img
from eval_helpers import make_small_features
from omegaconf import OmegaConf
from PIL import Image
from run_helpers import run_main_here
from test_evaluate_script import load_evaluate

from ldm import checkpoint

pytestmark = pytest.mark.slow

SCHEDULE = (
    "model.params.scheduler_config={target: ldm.optim.WarmupScheduler, params: {kind: cosine,"
    " warmup_steps: 1, total_steps: '${lightning.trainer.max_steps}'}}"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_config, shapes_dir):
    logs = tmp_path_factory.mktemp("logs")
    args = ["--base", str(tiny_config), f"data.params.train.params.data_root={shapes_dir}"]
    result = run_main_here([*args, SCHEDULE, "-l", str(logs), "-t"], cwd=logs)  # no 2nd start-up
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = logs.iterdir()
    return run


def project_file(run):
    (project,) = (run / "configs").glob("*-project.yaml")
    return project


def test_the_project_file_keeps_the_interpolation_and_the_value_it_had(run):
    saved = OmegaConf.load(project_file(run))
    params = saved.model.params.scheduler_config.params
    assert OmegaConf.to_container(params)["total_steps"] == "${lightning.trainer.max_steps}"
    assert params.total_steps == 2  # resolves in the file alone: the run's max_steps
    (lightning,) = (run / "configs").glob("*-lightning.yaml")
    assert OmegaConf.load(lightning).lightning.trainer.max_steps == 2


def sample_args(run, tmp_path, name):
    ckpt = run / "checkpoints" / "last.ckpt"
    return ["--ckpt", str(ckpt), "--config", str(project_file(run))] + [
        "--outdir", str(tmp_path / name), "--steps", "2", "--prompt", "a red circle",
        "--n_samples", "1", "--seed", "1",
    ]  # fmt: skip


def test_txt2img_and_img2img_take_the_saved_project_file(run, tmp_path, shapes_dir):
    txt2img.main(sample_args(run, tmp_path, "t2i"))
    assert Image.open(tmp_path / "t2i" / "samples" / "00000.png").mode == "RGB"
    init = sorted((shapes_dir / "images").glob("*.png"))[0]
    img2img.main([*sample_args(run, tmp_path, "i2i"), "--init-img", str(init)])
    assert (tmp_path / "i2i" / "samples" / "00000.png").exists()


def test_convert_takes_the_saved_project_file(run, tmp_path):
    out = tmp_path / "model.safetensors"
    convert.main(
        [str(run / "checkpoints" / "last.ckpt"), str(out), "--config", str(project_file(run))]
    )
    assert "model.diffusion_model.out.2.weight" in checkpoint.load_file_state(out)


def test_evaluate_takes_the_saved_project_file(run, tmp_path, shapes_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    out = tmp_path / "scores.json"
    load_evaluate().main(
        [
            str(run / "checkpoints" / "last.ckpt"),
            "--base", str(project_file(run)),
            "--prompts", str(prompts),
            "--reference", str(shapes_dir / "images"),
            "--features", str(make_small_features(tmp_path / "f.safetensors", size=32)),
            "--num-images", "2", "--batch-size", "2", "--steps", "2",
            "--kid-subsets", "1", "--kid-subset-size", "2",
            "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--out", str(out),
        ]
    )  # fmt: skip
    assert out.exists()


def test_a_new_run_takes_the_saved_project_file_as_base(run, tmp_path):
    result = run_main_here(
        ["--base", str(project_file(run)), "-l", str(tmp_path / "logs")], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cannot resolve" not in result.stderr
