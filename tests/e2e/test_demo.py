"""The demo: its pixel analysis reads the data set it trains on, and its config trains via main.py."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_shapes import Reading, Scores, analyze
from eval_shapes import main as eval_main
from make_shapes import SHAPE_COLORS, SHAPES, make_shapes
from PIL import Image
from run_helpers import record_demo_commands, train_demo


@pytest.mark.parametrize("size", [16, 32])
def test_pixel_analysis_reads_the_generated_images(tmp_path, size):
    shown = make_shapes(tmp_path, n=150, size=size, seed=3)
    scores = Scores()
    for item in shown:
        reading = analyze(np.asarray(Image.open(tmp_path / "images" / f"{item.name}.png")))
        scores.add(reading, item.color, item.shape)
    assert {item.color for item in shown} == set(SHAPE_COLORS)
    assert {item.shape for item in shown} == set(SHAPES)
    assert scores.percent(scores.color) >= 99.0, scores.summary()
    assert scores.percent(scores.shape) >= 98.0, scores.summary()


def test_pixel_analysis_finds_no_shape_in_a_plain_image():
    assert analyze(np.full((16, 16, 3), 128, dtype=np.uint8)) == Reading(None, None)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """2 training steps of the demo config on 8 generated images, as `make demo` runs it."""
    return train_demo(tmp_path_factory.mktemp("demo"))


@pytest.mark.slow
def test_demo_config_trains_with_ema(demo_run):
    state = torch.load(
        demo_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert state["global_step"] == 2
    # Pixel space: the UNet takes and predicts the 3 image channels; EMA weights are saved.
    assert state["state_dict"]["model.diffusion_model.input_blocks.0.0.weight"].shape[1] == 3
    assert int(state["state_dict"]["model_ema.num_updates"]) == 2


@pytest.mark.slow
def test_eval_scores_every_colour_and_shape(demo_run, capsys):
    grid = demo_run / "eval.png"
    eval_main(
        [
            "--ckpt",
            str(demo_run / "checkpoints" / "last.ckpt"),
            "--n",
            "1",
            "--steps",
            "2",
            "--grid",
            str(grid),
        ]
    )
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        summary.startswith("colour accuracy")
        and f"({len(SHAPE_COLORS) * len(SHAPES)} images)" in summary
    )
    # One 16 x 16 image per prompt, one row per prompt, 2 pixels of padding.
    assert Image.open(grid).size == (2 + 18, len(SHAPE_COLORS) * len(SHAPES) * 18 + 2)


def test_demo_makes_data_trains_draws_and_scores(tmp_path, monkeypatch, capsys):
    import demo

    run_folder = tmp_path / "logs" / "run"
    calls = record_demo_commands(monkeypatch, run_folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # restored after the test; --threads wins
    run_folder.mkdir(parents=True)
    data = tmp_path / "shapes"
    lr = "model.base_learning_rate=2.0e-4"
    demo.main(["--data", str(data), "--max-steps", "7", "--threads", "1", lr])

    assert [call[0] for call in calls] == [
        "scripts/make_shapes.py",
        "main.py",
        "scripts/txt2img.py",
        "scripts/eval_shapes.py",
    ]
    assert calls[0][calls[0].index("--size") + 1] == "16"  # the config's image size
    train = calls[1]
    assert f"data.params.train.params.data_root={data}" in train
    assert "lightning.trainer.max_steps=7" in train and "-t" in train
    assert train.index(lr) > train.index("lightning.trainer.max_steps=7")  # the user's wins
    prompts = (run_folder / "demo-prompts.txt").read_text().splitlines()
    assert len(prompts) == len(demo.PROMPTS)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    out = capsys.readouterr().out
    assert str(run_folder / "samples" / "grid-0000.png") in out
    enlarged = run_folder / "samples" / f"grid-0000-x{demo.ENLARGE}.png"
    assert str(enlarged) in out
    assert Image.open(enlarged).size == (20 * demo.ENLARGE, 38 * demo.ENLARGE)


def test_demo_refuses_an_override_without_a_value(capsys):
    import demo

    with pytest.raises(SystemExit) as stop:
        demo.main(["model.base_learning_rate"])
    assert stop.value.code == 2
    assert "'model.base_learning_rate': an override is key.path=value" in capsys.readouterr().err


def test_on_a_gpu_two_loader_workers_decode_ahead_of_the_step():
    """The demo config decodes in the step's process (a CPU run needs its cores for the step);
    on a GPU the step does not use the host's cores, so workers decode the next batches."""
    import demo

    from lun.config import merge_configs

    on_gpu = merge_configs([demo.CONFIG], demo.device_overrides(True))
    on_cpu = merge_configs([demo.CONFIG], demo.device_overrides(False))
    assert (on_gpu.data.params.num_workers, on_cpu.data.params.num_workers) == (2, 0)
