"""The conditioning seam: named fields, CFG dropout in the conditioner, the unconditional side,
the training target and noise checked against independent references (diffusers, hand formulas),
and a class-conditional backbone that plugs into LatentDiffusion."""

import math

import pytest
import torch
from torch import nn

from ldm.conditioning import ClassLabels, Conditioner, TextEmbedder
from ldm.diffusion import LatentDiffusion
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


class RecordingText(TextEmbedder):
    """A text embedder that records what it is asked to embed; each caption -> its length."""

    def __init__(self, ucg_rate=0.0):
        super().__init__(ucg_rate=ucg_rate)
        self.seen = []

    def forward(self, captions):
        self.seen.append(list(captions))
        return torch.tensor([[[float(len(c))]] for c in captions])  # (B, 1, 1)


def test_ucg_rate_drops_captions_at_the_rate():
    embedder = RecordingText(ucg_rate=0.3)
    out = embedder.condition(
        {"caption": ["a cat"] * 20000}, torch.Generator().manual_seed(0), drop=True
    )
    captions = embedder.seen[-1]
    dropped = sum(c == "" for c in captions) / len(captions)
    assert abs(dropped - 0.3) < 0.015
    assert set(captions) == {"", "a cat"}
    assert set(out["crossattn"].flatten().tolist()) == {0.0, 5.0}
    # Not when not asked (validation, sampling), nor at rate 0.
    embedder.condition({"caption": ["a cat"] * 100}, drop=False)
    assert embedder.seen[-1] == ["a cat"] * 100
    RecordingText(ucg_rate=0.0).condition({"caption": ["a cat"] * 100}, drop=True)
    with pytest.raises(ValueError, match="ucg_rate"):
        RecordingText(ucg_rate=1.5)


def test_class_labels_drop_to_the_null_class():
    labels = ClassLabels(num_classes=10, ucg_rate=0.5)
    assert isinstance(labels, Conditioner)
    batch = {"label": torch.arange(10).repeat(200)}
    y = labels.condition(batch, torch.Generator().manual_seed(0), drop=True)["y"]
    null = y == 10
    assert 0.45 < null.float().mean() < 0.55
    assert torch.equal(y[~null], batch["label"][~null])  # the rest unchanged
    assert torch.equal(labels.unconditional(batch)["y"], torch.full((2000,), 10))
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        labels.condition({"label": torch.tensor([11])})


@pytest.fixture
def tiny(tiny_config):
    def build(**overrides):
        dotlist = [f"model.params.{k}={v}" for k, v in overrides.items()]
        torch.manual_seed(0)
        return instantiate_from_config(to_container(merge_configs([tiny_config], dotlist))["model"])

    return build


class FixedOutput(nn.Module):
    """A backbone stub: records (x_t, t, cond) and returns a fixed, non-zero prediction."""

    def __init__(self, shape):
        super().__init__()
        self.in_channels, self.size_multiple, self.image_size = shape[1], 1, shape[-1]
        self.output = nn.Parameter(torch.linspace(-1, 1, math.prod(shape)).view(shape))
        self.calls = []

    def forward(self, x, t, cond):
        self.calls.append((x.clone(), t.clone(), {k: v.clone() for k, v in cond.items()}))
        return self.output.repeat(x.shape[0] // len(self.output), 1, 1, 1)  # (B, C, H, W)


def latent_batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return {"latent": torch.randn(n, 4, 8, 8, generator=g), "caption": ["a", "b", "c", "d"][:n]}


@pytest.mark.parametrize("offset_noise", [0.0, 0.5])
@pytest.mark.parametrize("parameterization", ["eps", "v"])
def test_training_target_matches_diffusers_and_the_noise_formula(
    tiny, parameterization, offset_noise
):
    """x_t and the target (eps, or v from diffusers' own `get_velocity`) are recomputed from the
    generator's draws, in the order the loss makes them: t, noise, then the offset noise."""
    from diffusers import DDPMScheduler

    model = tiny(parameterization=parameterization, offset_noise=offset_noise).eval()
    batch = latent_batch()
    stub = FixedOutput(batch["latent"].shape)
    model.model.diffusion_model = stub
    _, per_sample, t = model.diffusion_loss(batch, torch.Generator().manual_seed(5))

    z, b = batch["latent"], 4
    g = torch.Generator().manual_seed(5)
    t_ref = torch.randint(0, 1000, (b,), generator=g)
    noise = torch.randn(z.shape, generator=g)
    if offset_noise:  # Guttenberg 2023: one extra N(0, 1) per sample and channel
        noise = noise + offset_noise * torch.randn(b, 4, 1, 1, generator=g)
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    assert torch.equal(t, t_ref)
    x_t = scheduler.add_noise(z, noise, t_ref)
    torch.testing.assert_close(stub.calls[-1][0], x_t, rtol=1e-5, atol=1e-5)
    target = noise if parameterization == "eps" else scheduler.get_velocity(z, noise, t_ref)
    expected = (stub.output - target).square().mean(dim=(1, 2, 3))
    torch.testing.assert_close(per_sample, expected, rtol=1e-5, atol=1e-6)


def test_training_drops_captions_through_the_conditioner_and_validation_does_not(tiny):
    model = tiny(ucg_rate=0.5)
    encoder = model.cond_stage_model
    assert encoder.ucg_rate == 0.5  # the legacy model-level key reaches its one owner
    seen = []
    forward = encoder.forward
    encoder.forward = lambda captions: seen.append(list(captions)) or forward(captions)
    batch = {**latent_batch(n=4), "caption": ["x"] * 4}
    batch["latent"] = batch["latent"][:, :, :8, :8]
    model.train()
    for seed in range(8):
        model.diffusion_loss(batch, torch.Generator().manual_seed(seed))
    dropped = sum(c == "" for captions in seen for c in captions)
    assert 6 < dropped < 26  # of 32, at rate 0.5
    seen.clear()
    model.eval()
    model.diffusion_loss(batch, torch.Generator().manual_seed(0))
    assert seen == [["x"] * 4]


def test_guidance_unconditional_side_is_the_empty_or_negative_prompt(tiny):
    model = tiny().eval()
    stub = FixedOutput((2, 4, 8, 8))
    model.model.diffusion_model = stub
    model.sample(
        ["a red circle", "a blue square"],
        steps=1,
        scale=3.0,
        height=16,
        width=16,
        generator=torch.Generator().manual_seed(0),
    )
    _, _, cond = stub.calls[-1]
    uncond_half, cond_half = cond["crossattn"].chunk(2)
    encoder = model.cond_stage_model
    with torch.no_grad():
        torch.testing.assert_close(uncond_half, encoder(["", ""]))
        torch.testing.assert_close(cond_half, encoder(["a red circle", "a blue square"]))
    model.sample(
        ["a red circle"],
        ["blurry"],
        steps=1,
        scale=3.0,
        height=16,
        width=16,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        torch.testing.assert_close(stub.calls[-1][2]["crossattn"][:1], encoder(["blurry"]))


class ToyClassBackbone(nn.Module):
    """A tiny class-conditional network (no text): it embeds the label (with a null row) and the
    time, and predicts eps per pixel with 1x1 convolutions."""

    def __init__(self, channels=3, num_classes=2, width=32):
        super().__init__()
        self.in_channels, self.size_multiple, self.image_size = channels, 1, 4
        self.labels = nn.Embedding(num_classes + 1, width)
        self.time = nn.Linear(2, width)
        self.net = nn.Sequential(
            nn.Conv2d(channels + width, width, 1), nn.SiLU(), nn.Conv2d(width, channels, 1)
        )

    def forward(self, x, t, cond):
        phase = t.float()[:, None] / 1000 * math.pi
        emb = self.labels(cond["y"]) + self.time(torch.cat([phase.sin(), phase.cos()], dim=1))
        emb = emb[:, :, None, None].expand(-1, -1, *x.shape[-2:])
        return self.net(torch.cat([x, emb], dim=1))


def test_a_class_conditional_backbone_trains_and_samples_with_guidance():
    """Labels, no text: class 0 images are red, class 1 blue; after training, guided samples of
    each class come out in their colour."""
    torch.manual_seed(0)
    model = LatentDiffusion(
        backbone_config={"target": f"{__name__}.ToyClassBackbone"},
        first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
        conditioner_config={
            "target": "ldm.conditioning.ClassLabels",
            "params": {"num_classes": 2, "ucg_rate": 0.2},
        },
        scale_factor=1.0,
        schedule={"beta_schedule": "cosine"},
    )
    colours = torch.tensor([[0.8, -0.8, -0.8], [-0.8, -0.8, 0.8]])  # red, blue in [-1, 1]
    optimizer = torch.optim.Adam(model.model.parameters(), lr=2e-2)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(100):
        labels = torch.randint(0, 2, (32,), generator=g)
        images = colours[labels][:, :, None, None].expand(-1, -1, 4, 4)
        loss, _, _ = model.diffusion_loss({"image": images, "label": labels})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    samples = model.sample(
        torch.tensor([0, 1] * 4), scale=3.0, steps=20, generator=torch.Generator().manual_seed(1)
    )
    assert samples.shape == (8, 3, 4, 4)
    mean = samples.mean(dim=(2, 3))  # (8, 3)
    red, blue = mean[0::2], mean[1::2]
    assert (red[:, 0] > red[:, 2] + 0.5).all(), red
    assert (blue[:, 2] > blue[:, 0] + 0.5).all(), blue


class NamedConditioner(ClassLabels):
    """A conditioner with weights that names its checkpoint level, as sgm's (SDXL's) does."""

    checkpoint_name = "conditioner"

    def __init__(self, num_classes: int):
        super().__init__(num_classes)
        self.scale = nn.Parameter(torch.ones(1))


def test_the_conditioner_keeps_the_checkpoint_name_it_asks_for():
    model = LatentDiffusion(
        backbone_config={"target": f"{__name__}.ToyClassBackbone"},
        first_stage_config={"target": "ldm.autoencoder.IdentityFirstStage"},
        conditioner_config={"target": f"{__name__}.NamedConditioner", "params": {"num_classes": 2}},
    )
    assert "conditioner.scale" in model.state_dict()
    assert not any(k.startswith("cond_stage_model.") for k in model.state_dict())
    assert isinstance(model.conditioner, NamedConditioner)
