"""The evaluation callback: FID / KID / CLIP during training, the best checkpoint by eval/fid,
EMA and raw weights, and its config errors before the run folder exists."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from callback_testing import IMAGE_SIZE, TinyDiffusion
from lightning.pytorch import Callback
from PIL import Image
from run_helpers import TORCHRUN_TWO, load_main
from safetensors.torch import save_file

from lun.callbacks.checkpoints import Checkpoint
from lun.callbacks.ema import EMA
from lun.callbacks.evaluation import Evaluation
from lun.eval.features import SmallCNN


@pytest.fixture
def eval_files(tmp_path):
    """A SmallCNN features file, a folder of 12 real images and a prompt file."""
    torch.manual_seed(0)
    net = SmallCNN(num_classes=3, widths=(8, 16), size=IMAGE_SIZE)
    features = tmp_path / "features.safetensors"
    save_file(net.state_dict(), str(features), metadata=net.metadata())
    real = tmp_path / "real"
    real.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):  # smooth colour fields, unlike the untrained model's noise
        colour = rng.integers(0, 256, 3)
        pixels = np.broadcast_to(colour, (IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
        Image.fromarray(pixels).save(real / f"{i:02d}.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square\n")
    return {"features": str(features), "reference": str(real), "prompts": str(prompts)}


class Recorder(Callback):
    """The eval metrics in callback_metrics after each step of `every` (an evaluation)."""

    def __init__(self, every: int):
        self.seen, self.every = {}, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "eval/" in k}
            self.seen.setdefault(trainer.global_step, metrics)


def test_metrics_reach_callback_metrics_and_the_best_checkpoint(
    tmp_path, eval_files, make_module, make_loader, fit
):
    evaluation = Evaluation(
        **eval_files,
        every_n_steps=2,
        num_eval_images=6,
        batch_size=4,
        steps=3,
        weights=["ema", "raw"],
        kid_subset_size=4,
        kid_subsets=5,
        at_end=False,
        save_images=True,
        cache_dir=str(tmp_path / "cache"),
    )
    recorder = Recorder(every=2)
    best = Checkpoint(
        dirpath=str(tmp_path / "ckpt"), monitor="eval/fid", mode="min", every_n_train_steps=2
    )
    ema = EMA(decay=0.5, async_update=False)
    trainer = fit(
        make_module(), [ema, evaluation, recorder, best], make_loader(batches=6), max_steps=6
    )
    assert sorted(recorder.seen) == [2, 4, 6]
    fids = {step: m["eval/fid"] for step, m in recorder.seen.items()}
    for metrics in recorder.seen.values():
        assert metrics["eval/num_images"] == 6 and metrics["eval/kid_std"] >= 0
        assert metrics["eval/fid"] > 0 and metrics["eval/raw/fid"] > 0
        assert metrics["eval/fid"] != metrics["eval/raw/fid"]  # EMA and raw weights differ
    assert len(set(fids.values())) == 3  # training changed the images
    assert float(best.best_model_score) == pytest.approx(min(fids.values()), rel=1e-6)
    assert best.best_model_path.endswith("best.ckpt")
    saved = sorted((tmp_path / "images" / "eval" / "gs-000004").glob("*.png"))
    assert [p.stem for p in saved] == [f"{i:05d}" for i in range(6)]  # image i of the 6
    grids = sorted((tmp_path / "images" / "eval").glob("*.png"))
    assert [g.name for g in grids] == [f"samples_gs-{s:06d}.png" for s in (2, 4, 6)]
    # The same weights and seeds give the same numbers (logged as float32): a fresh evaluation
    # agrees.
    again = evaluation.evaluate(trainer, trainer.lightning_module)
    assert again["eval/raw/fid"] == pytest.approx(recorder.seen[6]["eval/raw/fid"], rel=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompts": "nope.txt"}, "prompts=nope.txt: prompt file not found"),
        ({"features": "missing.pth"}, "features=missing.pth: feature-extractor weights not found"),
        ({"weights": ["ema", "best"]}, "weights=['ema', 'best']"),
        ({"classes": [1, 2]}, "prompts: give a prompt file or `classes`"),
        ({"clip": "no-clip"}, "clip=no-clip: no CLIP model folder"),
        ({"every_n_steps": 0}, "every_n_steps=0: expected a whole number >= 1"),
    ],
)
def test_bad_settings_are_refused_by_name(eval_files, change, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Evaluation(**{**eval_files, **change})


def test_launcher_refuses_a_missing_prompt_file_before_the_run_folder(
    tmp_path, tiny_config, shapes_dir, eval_files, capsys
):
    key = "lightning.callbacks.evaluation"
    status = load_main().main(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            f"{key}.target=lun.callbacks.evaluation.Evaluation",
            f"{key}.params.reference={eval_files['reference']}",
            f"{key}.params.features={eval_files['features']}",
            f"{key}.params.prompts={tmp_path}/absent.txt",
            "-l",
            str(tmp_path / "logs"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1] == (
        f"config error: {key}.params.prompts={tmp_path}/absent.txt: prompt file not found "
        "(one prompt per line)"
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow  # the launcher training the tiny LatentDiffusion
def test_launcher_run_logs_eval_metrics_with_clip_and_keeps_the_best(
    tmp_path, tiny_config, shapes_dir, eval_files
):
    """The README's YAML through main.py: the real model draws from prompts, TensorBoard gets
    eval/fid, eval/kid, eval/kid_std and eval/clip_score, and best-fid.ckpt is written."""
    from eval_helpers import make_clip_folder, make_small_features
    from run_helpers import run_main_here  # main() here: no second start-up of torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = "lightning.callbacks.evaluation"
    best = "lightning.callbacks.best_fid"
    result = run_main_here(
        [
            "--base",
            str(tiny_config),
            f"data.params.train.params.data_root={shapes_dir}",
            f"{ev}.target=lun.callbacks.evaluation.Evaluation",
            f"{ev}.params.reference={shapes_dir / 'images'}",
            f"{ev}.params.features={make_small_features(tmp_path / 'f.safetensors', size=32)}",
            f"{ev}.params.prompts={eval_files['prompts']}",
            f"{ev}.params.clip={make_clip_folder(tmp_path / 'clip')}",
            f"{ev}.params.every_n_steps=1",
            f"{ev}.params.num_eval_images=4",
            f"{ev}.params.steps=2",
            f"{ev}.params.kid_subset_size=3",
            f"{ev}.params.cache_dir={tmp_path / 'cache'}",
            f"{best}.target=lun.callbacks.checkpoints.Checkpoint",
            f"{best}.params={{monitor: eval/fid, mode: min, every_n_train_steps: 1, filename: best-fid}}",
            "-l",
            str(tmp_path / "logs"),
            "-t",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "logs").iterdir()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for tag in ("eval/fid", "eval/kid", "eval/kid_std", "eval/clip_score"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2], tag
    assert all(0 <= e.value <= 100 for e in events.Scalars("eval/clip_score"))
    assert "eval/samples" in events.Tags()["images"]
    assert (run / "checkpoints" / "best-fid.ckpt").is_file()


DDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from callback_testing import RandomImages, TinyDiffusion
from lun.callbacks.evaluation import Evaluation

settings, out = json.loads(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
module = TinyDiffusion(learning_rate=0.0)  # the seed-0 weights on both ranks, after training too
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    default_root_dir=out, callbacks=[Evaluation(**settings)])
trainer.fit(module, DataLoader(RandomImages(8), batch_size=2))
import torch.distributed
torch.distributed.destroy_process_group()  # as main.py does: gloo can abort at exit otherwise
metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval/")}
metrics.pop("eval/seconds")  # each rank's own wall time
with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(metrics, f)
"""


@pytest.mark.slow  # two torchrun processes
def test_two_processes_score_the_single_process_images(tmp_path, eval_files, make_loader, fit):
    """7 images in batches of 2 on 2 ranks (rank 0 draws batches 0 and 2, rank 1 batches 1 and
    3, the last one image): the same images, each counted once, so the figures of one process;
    every rank gets them."""
    from eval_helpers import make_clip_folder

    settings = dict(
        **eval_files,
        clip=str(make_clip_folder(tmp_path / "clip")),
        every_n_steps=100,  # only the evaluation at the end
        num_eval_images=7,
        batch_size=2,
        steps=3,
        kid_subset_size=4,
        kid_subsets=5,
        grid_images=0,
        save_images=True,
    )
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    script = tmp_path / "ddp_evaluation.py"
    script.write_text(DDP_SCRIPT)
    command = [*TORCHRUN_TWO, str(script)]
    here = str(Path(__file__).parent)
    cache = dict(cache_dir=str(tmp_path / "cache-ddp"))
    result = subprocess.run(
        command + [here, json.dumps({**settings, **cache}), str(ddp)],
        env={**os.environ, "PYTHONPATH": str(Path(here).parents[2]), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((ddp / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # rank 0 computed, everyone got the figures

    torch.manual_seed(0)
    single = Evaluation(**settings, cache_dir=str(tmp_path / "cache-one"))
    trainer = fit(TinyDiffusion(learning_rate=0.0), [single], make_loader(), max_steps=1)
    one = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval/")}
    assert one["eval/num_images"] == ranks[0]["eval/num_images"] == 7
    for name in ("eval/fid", "eval/kid", "eval/kid_std", "eval/clip_score"):
        assert ranks[0][name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
    # The images themselves: the ones each rank saved are the one process's, byte for byte.
    saved = sorted((ddp / "images" / "eval" / "gs-000001").glob("*.png"))
    assert [p.stem for p in saved] == [f"{i:05d}" for i in range(7)]
    for path in saved:
        assert path.read_bytes() == (tmp_path / "images/eval/gs-000001" / path.name).read_bytes()
