import hashlib
import json
from pathlib import Path

import pytest
import torch

from ldm.diffusion import LatentDiffusion
from ldm.util import instantiate_from_config
from ldm.validation import clean_latent
from lun.config import merge_configs, to_container

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"
# sha256 of the original CompVis / Stability-AI inference configs: ours must stay unchanged.
ORIGINAL_SHA256 = {
    "v1-inference.yaml": "20b7f0acae54d1f88384a6ca15b5d62c0ee4fbbca07ff72f3761fe936083210d",
    "v2-inference.yaml": "ec4094bd36ef558cd9d52c9985471ac91d2c0c5bd071717411a4ccd5adf4f311",
    "v2-inference-v.yaml": "72b092aadfe146f5d3f395a720c0aa3b2354b2095e3f10dc18f0e9716d286dcb",
}


def model_config(path, **overrides):
    dotlist = [f"model.params.{k}={v}" for k, v in overrides.items()]
    return to_container(merge_configs([path], dotlist))["model"]


@pytest.fixture
def tiny(tiny_config):
    def build(**overrides):
        torch.manual_seed(0)
        return instantiate_from_config(model_config(tiny_config, **overrides))

    return build


@pytest.mark.parametrize(
    "config, reference",
    [
        ("v1-inference.yaml", "sd_v1_keys.json"),
        ("v2-inference.yaml", "sd_v2_base_keys.json"),
        ("v2-inference-v.yaml", "sd_v2_v_keys.json"),
    ],
)
def test_original_configs_build_exactly_the_original_layout(config, reference):
    """The shipped configs are the originals, unchanged; their models have the reference keys/shapes."""
    shipped = ROOT / "configs" / "stable-diffusion" / config
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == ORIGINAL_SHA256[config]
    with torch.device("meta"):
        model = instantiate_from_config(model_config(shipped))
    assert isinstance(model, LatentDiffusion)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    expected = json.loads((REFERENCE / reference).read_text())["keys"]
    # position_ids is a constant some library versions store and others do not; loaders ignore it.
    expected.pop("cond_stage_model.transformer.text_model.embeddings.position_ids", None)
    assert sorted(set(ours) ^ set(expected)) == []
    assert {k: ours[k] for k in expected} == expected
    assert model.parameterization == ("v" if "-v" in config else "eps")


def test_unknown_model_parameter_is_named(tiny_config):
    config = model_config(tiny_config)
    config["params"]["min_snr_gama"] = 5
    with pytest.raises(TypeError, match="min_snr_gama"):
        instantiate_from_config(config)


def fixed_batch(repeat: int = 1):
    g = torch.Generator().manual_seed(1)
    captions = ["a red circle", "a blue square", "a green triangle", "a red square"] * repeat
    return {"image": torch.rand(len(captions), 3, 32, 32, generator=g) * 2 - 1, "caption": captions}


@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_tiny_model_learns_a_fixed_batch(tiny, parameterization):
    model = tiny(parameterization=parameterization)
    model.train()
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=3e-3)
    batch = fixed_batch()
    losses = []
    for _ in range(12):
        # The same t and noise every step, so the loss measures fitting, not sampling luck.
        loss, _, _ = model.diffusion_loss(batch, torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_frozen_parts_get_no_gradients_and_stay_in_eval(tiny):
    model = tiny()
    model.train()
    assert not model.first_stage_model.training and not model.cond_stage_model.training
    loss, _, _ = model.diffusion_loss(fixed_batch())
    loss.backward()
    assert all(p.grad is None for p in model.first_stage_model.parameters())
    assert all(p.grad is None for p in model.cond_stage_model.parameters())
    assert all(p.grad is not None for p in model.model.parameters())
    params = model.configure_optimizers().param_groups[0]["params"]
    assert len(params) == len(list(model.model.parameters()))


def test_trainable_text_encoder_gets_gradients_and_optimizer_state(tiny):
    model = tiny(cond_stage_trainable=True)
    model.train()
    assert model.cond_stage_model.training
    loss, _, _ = model.diffusion_loss(fixed_batch())
    loss.backward()
    assert any(p.grad is not None for p in model.cond_stage_model.parameters())
    n_params = len(list(model.model.parameters())) + len(list(model.cond_stage_model.parameters()))
    assert len(model.configure_optimizers().param_groups[0]["params"]) == n_params


@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_min_snr_weights_the_per_sample_loss(tiny, parameterization):
    plain = tiny(parameterization=parameterization)
    weighted = tiny(parameterization=parameterization, min_snr_gamma=5.0)
    weighted.load_state_dict(plain.state_dict())
    batch = fixed_batch(repeat=4)
    _, loss_plain, t = plain.diffusion_loss(batch, torch.Generator().manual_seed(3))
    _, loss_weighted, t2 = weighted.diffusion_loss(batch, torch.Generator().manual_seed(3))
    assert torch.equal(t, t2)
    abar = plain.alphas_cumprod[t].double()
    snr = abar / (1 - abar)
    expected = snr.clamp(max=5.0) / (snr if parameterization == "eps" else snr + 1)
    assert (
        (expected < 1).any() and (expected == 1).any()
        if parameterization == "eps"
        else (expected < 1).all()
    )
    torch.testing.assert_close(
        loss_weighted.double(), loss_plain.double() * expected, rtol=1e-5, atol=1e-7
    )


def test_zero_terminal_snr_and_offset_noise_change_training(tiny):
    model = tiny(zero_terminal_snr=True, parameterization="v", offset_noise=0.1)
    assert model.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-12)
    base = tiny(parameterization="v")
    base.load_state_dict(model.state_dict(), strict=False)
    loss, _, _ = model.diffusion_loss(fixed_batch(), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_sample_is_deterministic_and_has_the_asked_size(tiny):
    model = tiny().eval()
    kwargs = dict(height=32, width=32, steps=3, scale=3.0)
    a = model.sample(["a red circle"] * 2, generator=torch.Generator().manual_seed(7), **kwargs)
    b = model.sample(["a red circle"] * 2, generator=torch.Generator().manual_seed(7), **kwargs)
    c = model.sample(["a red circle"] * 2, generator=torch.Generator().manual_seed(8), **kwargs)
    assert a.shape == (2, 3, 32, 32) and a.min() >= -1 and a.max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="multiples"):
        model.sample(["x"], height=30, width=32, steps=2)
    logs = model.log_images(fixed_batch(), N=2, steps=2, reconstructions=True)
    assert {"inputs", "reconstructions", "samples"} <= set(logs)
    assert logs["samples"].shape == (2, 3, 32, 32)


# --- the latent geometry: model latents = (z - shift_factor) * scale_factor -------------------
def test_latents_are_shifted_and_scaled_as_the_first_stage_says(tiny):
    """SD3-style geometry (diffusers' AutoencoderKL `shift_factor`, `scaling_factor`): the
    formula written out against the VAE's own encode/decode."""
    model = tiny(
        scale_factor="null",
        **{"first_stage_config.params.scale_factor": 2.0},
        **{"first_stage_config.params.shift_factor": 0.3},
    ).eval()
    vae = model.first_stage_model
    assert (model.scale_factor, model.shift_factor) == (2.0, 0.3)
    images = fixed_batch()["image"]
    z = vae.encode(images).sample(torch.Generator().manual_seed(4))
    latents = model.encode_first_stage(images, torch.Generator().manual_seed(4))
    torch.testing.assert_close(latents, (z - 0.3) * 2.0)
    torch.testing.assert_close(model.decode_first_stage(latents), vae.decode(z), atol=1e-5, rtol=0)
    # cached posterior moments, and validation's clean latent (the posterior mean)
    moments = vae.quant_conv(vae.encoder(images))
    cached = model.cached_latent(moments, torch.Generator().manual_seed(4))
    torch.testing.assert_close(cached, (z - 0.3) * 2.0)
    mean = moments[:, :4]
    torch.testing.assert_close(clean_latent(model, {"image": images}), (mean - 0.3) * 2.0)
    torch.testing.assert_close(clean_latent(model, {"latent": moments}), (mean - 0.3) * 2.0)


def test_the_compvis_scale_factor_wins_and_the_defaults_are_sds(tiny):
    given = tiny(**{"first_stage_config.params.scale_factor": 2.0})  # the config says 0.18215
    assert (given.scale_factor, given.shift_factor) == (0.18215, 0.0)
    neither = tiny(scale_factor="null")
    assert (neither.scale_factor, neither.shift_factor) == (0.18215, 0.0)
    images = fixed_batch()["image"]
    z = neither.first_stage_model.encode(images).sample(torch.Generator().manual_seed(4))
    latents = neither.encode_first_stage(images, torch.Generator().manual_seed(4))
    torch.testing.assert_close(latents, z * 0.18215)


def test_a_pixel_space_model_has_unit_geometry():
    from ldm.diffusion import LatentDiffusion

    model = LatentDiffusion(
        backbone_config={
            "target": "ldm.dit.DiT",
            "params": dict(input_size=8, patch_size=2, in_channels=3, hidden_size=16, depth=1),
        },
        first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
        conditioner_config={"target": "ldm.conditioning.ClassLabels", "params": {"num_classes": 2}},
    )
    assert (model.scale_factor, model.shift_factor) == (1.0, 0.0)
    images = fixed_batch()["image"][:, :, :8, :8]
    assert torch.equal(model.encode_first_stage(images), images)


# --- the constructor: grouped settings, the old flat spellings as adapters ------------------------
FLAT = {
    "min_snr_gamma": 5.0,
    "offset_noise": 0.1,
    "schedule.zero_terminal_snr": True,
    "channels_last": True,
    "first_stage_fp32": False,
}
GROUPED = {
    "objective": "{min_snr_gamma: 5.0, offset_noise: 0.1, schedule: {zero_terminal_snr: true}}",
    "speed": "{channels_last: true, first_stage_fp32: false}",
}


def test_the_flat_keys_mean_what_the_grouped_ones_do(tiny):
    flat, grouped = tiny(parameterization="v", **FLAT), tiny(parameterization="v", **GROUPED)
    for model in (flat, grouped):
        objective = model.objective
        assert (objective.name, objective.min_snr_gamma, objective.offset_noise) == ("v", 5.0, 0.1)
        assert model.alphas_cumprod[-1] == 0  # zero terminal SNR
        assert model.channels_last and not model.first_stage_fp32
    runs = [
        m.diffusion_loss(fixed_batch(), torch.Generator().manual_seed(2)) for m in (flat, grouped)
    ]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


def test_a_key_given_both_ways_or_unknown_is_named(tiny):
    from ldm.util import ParamError

    with pytest.raises(ParamError, match="give objective.offset_noise or offset_noise"):
        tiny(offset_noise=0.1, objective="{offset_noise: 0.2}")
    with pytest.raises(
        ParamError, match="unknown parameter 'ofset_noise'; did you mean 'offset_noise'"
    ):
        tiny(ofset_noise=0.1)
    with pytest.raises(ParamError, match=r"model.params.speed: unknown keys \['channel_last'\]"):
        tiny(speed="{channel_last: true}")


def test_the_constructor_takes_at_most_14_arguments_and_never_asks_the_objective():
    """Issue 31: LatentDiffusion <= 14 arguments (the old flat spellings come in through one
    adapter), and no branch on which objective it holds (its name, the flow, learn_sigma)."""
    import ast
    import inspect

    from ldm.diffusion import LatentDiffusion

    parameters = inspect.signature(LatentDiffusion).parameters.values()
    named = [p for p in parameters if p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 14, [p.name for p in named]
    tree = ast.parse((ROOT / "ldm" / "diffusion.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            assert not names & {"eps", "v", "flow"}, ast.unparse(node)
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("flow", "learn_sigma", "parameterization") or not (
                isinstance(node.ctx, ast.Load) and ast.unparse(node).startswith("self.")
            ), ast.unparse(node)


@pytest.mark.parametrize("parameterization", ["v", "flow"])
def test_every_objective_keeps_the_checkpoint_keys(tiny, parameterization):
    """The schedule buffers stay (CompVis names) whatever the objective: a file written by an eps
    model loads strictly into a v or flow model and back."""
    eps, other = tiny(), tiny(parameterization=parameterization)
    assert list(other.state_dict()) == list(eps.state_dict())
    other.load_state_dict(eps.state_dict())
