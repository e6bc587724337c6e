"""VAE training resumes exactly: N straight steps equal k steps + kill -9 + `--resume` + N - k
steps, bit for bit - both optimizers, the discriminator starting after the resume, the EMA (on
CPU Lightning turns 16-mixed into bf16-mixed: the fp16 gradient scalers' resume is tested in
tests/ldm/test_vae_training.py); and a 2-process DDP run on CPU trains the two optimizers."""

from pathlib import Path

import pytest
import torch
from run_helpers import ROOT, run_main
from test_resume import kill_after_first_checkpoint

TINY = ROOT / "configs" / "autoencoder" / "tiny.yaml"
STEPS, EVERY = 5, 2  # the discriminator starts at step 3: after the resume from step 2


def vae_args(shapes_dir: Path, logs: Path, *extra: str) -> list[str]:
    return [
        "--base", str(TINY),
        f"data.params.train.params.data_root={shapes_dir}",
        "data.params.train.params.flip_p=0.5",
        "model.params.lossconfig.params.perceptual_weight=0",  # VGG16: seconds a step on CPU
        "model.params.lossconfig.params.disc_start=3",
        "model.params.use_ema=true",
        "lightning.trainer.accelerator=cpu",
        f"lightning.trainer.max_steps={STEPS}",
        f"lightning.callbacks.modelcheckpoint.params.every_n_train_steps={EVERY}",
        "lightning.logger=false",
        *extra,
        "-l", str(logs), "-t",
    ]  # fmt: skip


def training_state(path: Path) -> dict[str, torch.Tensor]:
    """Weights (generator, discriminator and its BatchNorm statistics, EMA) and both optimizers'
    moments of a checkpoint, by name."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    state = dict(saved["state_dict"])
    for i, optimizer in enumerate(saved["optimizer_states"]):
        for index, moments in optimizer["state"].items():
            for name, value in moments.items():
                state[f"optimizer{i}.{index}.{name}"] = torch.as_tensor(value)
    state["global_step"] = torch.tensor(saved["global_step"])
    return state


@pytest.mark.slow
def test_vae_resume_is_bitwise_exact(tmp_path, shapes_dir):
    straight = run_main(vae_args(shapes_dir, tmp_path / "straight"), cwd=tmp_path, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    (run,) = (tmp_path / "straight").iterdir()

    logs = tmp_path / "interrupted"
    killed_at = kill_after_first_checkpoint(vae_args(shapes_dir, logs), tmp_path, logs, EVERY)
    at_k = training_state(killed_at)  # read now: the resumed run writes this file again
    assert 0 < int(at_k["global_step"]) < STEPS  # k = 2 (or 4, had the kill come late)
    resumed = run_main(["--resume", str(killed_at), "-t"], cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected = training_state(run / "checkpoints" / "last.ckpt")
    got = training_state(killed_at.parent / "last.ckpt")
    assert int(got["global_step"]) == STEPS and got.keys() == expected.keys()
    assert any(k.startswith("optimizer1.") for k in got)  # the discriminator stepped
    assert any(k.startswith("model_ema.") for k in got)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} differ, e.g. {differ[:4]}"
    # The discriminator trained after the resume: its weights moved from step k's.
    disc = "loss.discriminator.main.0.weight"
    assert not torch.equal(at_k[disc], got[disc])


@pytest.mark.slow
def test_two_process_ddp_trains_both_optimizers(tmp_path, shapes_dir):
    ddp = ROOT / "configs" / "lightning" / "ddp.yaml"
    on_cpu_with_2 = [
        "lightning.trainer.devices=2",
        "lightning.strategy.params.find_unused_parameters=true",
    ]
    args = vae_args(shapes_dir, tmp_path / "logs", str(ddp), *on_cpu_with_2)
    args[args.index("model.params.lossconfig.params.disc_start=3")] = (
        "model.params.lossconfig.params.disc_start=1"
    )
    result = run_main(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "logs").iterdir()
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STEPS  # one step per batch on each rank
    assert len(saved["optimizer_states"]) == 2 and saved["optimizer_states"][1]["state"]
