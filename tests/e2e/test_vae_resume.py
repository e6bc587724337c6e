"""VAE training resumes exactly: N straight steps equal k steps + kill -9 + `--resume` + N - k
steps, bit for bit - both optimizers, the discriminator starting after the resume, the EMA (on
CPU Lightning turns 16-mixed into bf16-mixed: the fp16 gradient scalers' resume is tested in
tests/ldm/test_vae_training.py); and 2-process runs on CPU: FSDP trains as DDP does, and resumes."""

from pathlib import Path

import pytest
import torch
from run_helpers import ROOT, failure_lines, free_ports, run_main, start_main
from test_resume import kill_after_first_checkpoint

from ldm.autoencoder import AutoencoderKL

TINY = ROOT / "configs" / "autoencoder" / "tiny.yaml"
TINY_DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
    num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
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
    moments of a checkpoint, by name (moments by their place in their optimizer: FSDP numbers
    them by the place in the module)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    state = dict(saved["state_dict"])
    for i, optimizer in enumerate(saved["optimizer_states"]):
        first = min(optimizer["state"], default=0)
        for index, moments in optimizer["state"].items():
            index -= first
            for name, value in moments.items():
                state[f"optimizer{i}.{index}.{name}"] = torch.as_tensor(value)
    state["global_step"] = torch.tensor(saved["global_step"])
    return state


@pytest.mark.slow
def test_vae_resume_is_bitwise_exact(tmp_path, shapes_dir):
    # The straight run goes on beside the interrupted one (a core is idle in a launch's start-up).
    straight_args = vae_args(shapes_dir, tmp_path / "straight")
    straight = start_main(straight_args, tmp_path, tmp_path / "straight.err")
    logs = tmp_path / "interrupted"
    try:
        killed_at = kill_after_first_checkpoint(vae_args(shapes_dir, logs), tmp_path, logs, EVERY)
    finally:
        straight.wait(timeout=600)
    assert straight.returncode == 0, (tmp_path / "straight.err").read_text()[-3000:]
    (run,) = (tmp_path / "straight").iterdir()
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


def kernels(state: dict) -> dict[str, torch.Tensor]:
    """The conv / linear kernels (and their EMA shadows). Left out: biases that a GroupNorm
    right after cancels (1 channel a group at this width): their gradient is 0 up to rounding,
    which Adam turns into full +-lr steps of either sign in any two runs."""
    return {k: v for k, v in state.items() if not k.startswith("optimizer") and v.dim() > 1}


@pytest.mark.slow
def test_two_process_fsdp_trains_as_ddp(tmp_path, shapes_dir):
    """2 processes on CPU (gloo), 3 steps under DDP and under FSDP (configs/lightning/
    fsdp-vae.yaml: each part its own root, a unit per block): both optimizers step, with the
    adaptive weight from the step, and the weights agree; FSDP's checkpoint loads as a VAE."""
    two = ["lightning.trainer.devices=2", "lightning.trainer.max_steps=3"]
    ddp = [str(ROOT / "configs" / "lightning" / "ddp.yaml"), *two]
    ddp.append("lightning.strategy.params.find_unused_parameters=true")
    fsdp = [str(ROOT / "configs" / "lightning" / "fsdp-vae.yaml"), *two]
    # Both launched at once, each with a rendezvous port of its own: a launch leaves a core idle
    # much of its start-up (rank 1 starts once rank 0 is set up).
    launched = {}
    for (name, extra), port in zip((("ddp", ddp), ("fsdp", fsdp)), free_ports(2), strict=True):
        args = vae_args(shapes_dir, tmp_path / name, *extra)
        args[args.index("model.params.lossconfig.params.disc_start=3")] = (
            "model.params.lossconfig.params.disc_start=1"
        )
        launched[name] = start_main(args, tmp_path, tmp_path / f"{name}.err", port)
    states = {}
    try:
        for name, process in launched.items():
            assert process.wait(timeout=600) == 0, failure_lines(
                (tmp_path / f"{name}.err").read_text()
            )
            (run,) = (tmp_path / name).iterdir()
            states[name] = training_state(run / "checkpoints" / "last.ckpt")
    finally:  # a failed run leaves no other going
        for process in launched.values():
            process.kill()
            process.wait()
    expected, got = states["ddp"], states["fsdp"]
    assert int(got["global_step"]) == int(expected["global_step"]) == 3
    assert got.keys() == expected.keys()  # both optimizers' states, EMA, the same names
    assert any(k.startswith("optimizer1.") for k in got)  # the discriminator stepped
    want = kernels(expected)
    assert len(want) > 50 and any(k.startswith("model_ema.") for k in want)
    # Float rounding apart: the attention runs SDPA's fused (flash) kernel, whose sums differ in
    # the last bits between the two strategies, and Adam turns that into up to ~2e-4 on the
    # few elements whose gradient is near zero (m / sqrt(v) of tiny values; lr is 1e-4). A real
    # difference in what is trained (a missed step, a wrong weight) moves most elements.
    for name, value in kernels(got).items():
        off = ((value - want[name]).abs() > 1e-5 + 1e-4 * want[name].abs()).float().mean()
        assert off <= 2e-3, f"{name}: {off:.2%} of the elements differ"
        torch.testing.assert_close(value, want[name], atol=5e-4, rtol=0, msg=name)
    ckpt = tmp_path / "fsdp-last.ckpt"
    torch.save(
        {
            "state_dict": {
                k: v for k, v in got.items() if k.count(".") > 0 and not k.startswith("optimizer")
            }
        },
        ckpt,
    )
    vae = AutoencoderKL(TINY_DDCONFIG, 4, ckpt_path=str(ckpt))  # strict
    assert torch.equal(vae.decoder.conv_out.weight, got["decoder.conv_out.weight"])
