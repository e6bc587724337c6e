"""The shapes demo trained with rectified flow: configs/demo/shapes-flow.yaml (the demo UNet) and
configs/demo/shapes-mmdit.yaml (a small MMDiT) train through main.py, learn the flow's velocity
and are drawn with flow Euler, checked against Esser et al. 2024 (arXiv:2403.03206) written out
here: x_t = (1 - t) x_0 + t e, target e - x_0 (sec. 2), t = sigmoid(u), u ~ N(0, 1) (sec. 3.1),
and Euler steps x <- x + (t_next - t) v on diffusers' SD3 step times."""

import functools
import math
from pathlib import Path

import pytest
import torch
from eval_shapes import main as eval_main
from make_shapes import SHAPE_COLORS, SHAPES
from run_helpers import ROOT, demo_run_folder, record_demo_commands, start_demo

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

DEMO = ROOT / "configs" / "demo"
OVERLAYS = ("shapes-flow.yaml", "shapes-mmdit.yaml")
# A parameter of each backbone, to tell which one a checkpoint holds.
BACKBONE_KEY = {
    "shapes-flow.yaml": "model.diffusion_model.input_blocks.0.0.weight",
    "shapes-mmdit.yaml": "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
}
PROMPTS = ["a red circle", "a blue square on a white background"]


@functools.cache  # built once per overlay: the tests only read it
def demo_model(overlay: str):
    """The overlay's model on shapes.yaml, its backbone weights drawn at random: an untrained
    backbone outputs zeros (zero-initialised output layers, adaLN-Zero), which every sampler
    would turn into the same image."""
    config = to_container(merge_configs([DEMO / "shapes.yaml", DEMO / overlay]))
    torch.manual_seed(0)
    model = instantiate_from_config(config["model"]).eval()
    with torch.no_grad():
        for parameter in model.backbone.parameters():
            parameter.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_demo_flow_configs_learn_the_velocity_of_the_straight_path(overlay):
    model = demo_model(overlay)
    generator = torch.Generator().manual_seed(1)
    x0 = torch.rand(2, 3, 16, 16, generator=generator) * 2 - 1
    noise = torch.randn(2, 3, 16, 16, generator=generator)
    t = torch.tensor([250.0, 700.0])  # the backbone's units: 1000 t
    with torch.no_grad():
        cond = model.conditioning(model.conditioner.batch_of(PROMPTS))
        loss = model.loss_at(x0, cond, t, noise, {})
        s = (t / 1000).view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        velocity_error = model.apply_model(x_t, t, cond) - (noise - x0)
    torch.testing.assert_close(loss, velocity_error.pow(2).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_demo_flow_configs_draw_t_logit_normal(overlay):
    """P(sigmoid(-1) < t < sigmoid(1)) = P(|u| < 1) = erf(1 / sqrt 2) = 68.3 % for u ~ N(0, 1);
    the eps/v demo's uniform DDPM steps give 46 %."""
    model = demo_model(overlay)
    t = model.objective.sample_t(20000, torch.Generator().manual_seed(0)) / 1000
    inside = ((t > 1 / (1 + math.e)) & (t < 1 / (1 + math.exp(-1)))).float().mean().item()
    assert abs(inside - math.erf(1 / math.sqrt(2))) < 0.015
    assert abs(t.median().item() - 0.5) < 0.01


def euler_by_hand(model, noise, steps: int, scale: float) -> torch.Tensor:
    """Flow Euler with classifier-free guidance on the velocity (Ho & Salimans 2022): diffusers'
    FlowMatchEulerDiscreteScheduler times for shift 1 (linspace(1, 1/1000, steps), then 0)."""
    times = [*torch.linspace(1.0, 1 / 1000, steps, dtype=torch.float64).tolist(), 0.0]
    batch = model.conditioner.batch_of(PROMPTS)
    cond, uncond = model.conditioning(batch), model.unconditional(batch)
    x = noise
    for t, t_next in zip(times[:-1], times[1:]):
        backbone_t = torch.full((x.shape[0],), t * 1000, dtype=torch.float32)
        v_cond = model.apply_model(x, backbone_t, cond)
        v_uncond = model.apply_model(x, backbone_t, uncond)
        x = x + (t_next - t) * (v_uncond + scale * (v_cond - v_uncond))
    return x.clamp(-1, 1)  # pixel space: the identity first stage


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("sampler", ["euler", "ddim"])  # the demo's; the image logger's default
def test_demo_flow_configs_are_drawn_with_flow_euler(overlay, sampler):
    """The image logger's path (`log_images`, seed 0), as the evaluation callback and txt2img
    sample through `LatentDiffusion.sample`; "ddim" on a flow is the same Euler step."""
    model = demo_model(overlay)
    with torch.no_grad():
        drawn = model.log_images(N=2, prompts=PROMPTS, seed=0, sampler=sampler, steps=3, scale=4.0)[
            "samples"
        ]
        noise = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        expected = euler_by_hand(model, noise, steps=3, scale=4.0)
    # The comparison has teeth only where the images are not clipped to [-1, 1].
    assert (expected.abs() < 0.98).float().mean() > 0.5
    assert (drawn - noise.clamp(-1, 1)).abs().max() > 0.05  # the backbone moved the pixels
    torch.testing.assert_close(drawn, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def flow_demo_launches(request, tmp_path_factory) -> dict:
    """The run of each overlay this session's tests ask for (`start_demo`: 2 training steps of
    shapes.yaml + the overlay on 8 generated images, as `python scripts/demo.py --config
    configs/demo/OVERLAY` trains it), launched at once: on 2 cores they go side by side.
    overlay -> (its folder, its process)"""
    wanted = {
        item.callspec.params["flow_demo_run"]
        for item in request.session.items
        if item.module is request.module and "flow_demo_run" in item.fixturenames
    }
    launches = {}
    for overlay in sorted(wanted):
        tmp = tmp_path_factory.mktemp("flow-demo")
        launches[overlay] = (tmp, start_demo(tmp, DEMO / overlay))
    yield launches
    for _, process in launches.values():  # a test that failed first leaves no run going
        process.kill()
        process.wait()


@pytest.fixture(scope="module", params=OVERLAYS)
def flow_demo_run(request, flow_demo_launches) -> tuple[str, Path]:
    """(the overlay, its run folder)"""
    overlay = request.param
    return overlay, demo_run_folder(*flow_demo_launches[overlay])


# Slow (one main.py launch per config, ~15 s each on 2 cores): the only proof that the overlays
# merge onto shapes.yaml and train through the launcher and its callbacks (EMA, checkpoints).
@pytest.mark.slow
def test_flow_demo_configs_train_and_are_scored(flow_demo_run, capsys):
    overlay, run = flow_demo_run
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 2
    assert state["state_dict"][BACKBONE_KEY[overlay]].dtype == torch.float32
    assert int(state["state_dict"]["model_ema.num_updates"]) == 2
    eval_main(["--ckpt", str(ckpt), "--n", "1", "--steps", "2", "--sampler", "euler"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("colour accuracy")
    assert f"({len(SHAPE_COLORS) * len(SHAPES)} images)" in summary


def test_demo_script_trains_the_overlay_and_draws_a_flow_model_with_euler(tmp_path, monkeypatch):
    import demo

    run_folder = tmp_path / "logs" / "run"
    run_folder.mkdir(parents=True)
    calls = record_demo_commands(monkeypatch, run_folder)
    (tmp_path / "shapes" / "images").mkdir(parents=True)  # no data set to make
    overlay = "configs/demo/shapes-flow.yaml"
    demo.main(["--data", str(tmp_path / "shapes"), "--config", overlay, "--threads", "1"])

    train, draw, score = calls
    bases = train[train.index("--base") + 1 : train.index("--base") + 3]
    assert bases == ("configs/demo/shapes.yaml", overlay)
    assert train[train.index("-n") + 1] == "demo-shapes-flow"
    for call in (draw, score):
        assert call[call.index("--sampler") + 1] == "euler"


def test_demo_script_refuses_a_missing_overlay(capsys):
    import demo

    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--config", "configs/demo/no-such.yaml"])
    assert exit_info.value.code == 2
    assert "--config configs/demo/no-such.yaml: no such file" in capsys.readouterr().err
