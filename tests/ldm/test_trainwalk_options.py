"""Training options do what docs/configs.md says, checked against references we did not write:
diffusers' `compute_snr` and the min-SNR weighting of its training scripts, diffusers'
`get_scheduler` and torch's `CosineAnnealingLR` for the LR schedules, and counts of what the
conditioner is handed for caption dropout (`ucg_rate`)."""

import math
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import compute_snr

from ldm import objectives
from ldm.conditioning import ClassLabels
from ldm.optim import WarmupScheduler
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


def tiny_model(tiny_config, *dotlist):
    torch.manual_seed(0)
    config = to_container(merge_configs([tiny_config], [f"model.params.{d}" for d in dotlist]))
    return instantiate_from_config(config["model"])


# --- min-SNR-gamma (Hang et al. 2023) against diffusers -----------------------------------------


@pytest.mark.parametrize("name", ["eps", "v"])
@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_weights_equal_diffusers_training_scripts(name, gamma):
    """diffusers' examples/text_to_image/train_text_to_image.py: min(SNR, gamma) / SNR for eps,
    min(SNR, gamma) / (SNR + 1) for v, with SNR from `training_utils.compute_snr`."""
    scheduler = DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
    )
    t = torch.arange(0, 1000, 7)
    snr = compute_snr(scheduler, t)
    clipped = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    expected = clipped / snr if name == "eps" else clipped / (snr + 1)

    objective = objectives.build(name, {"min_snr_gamma": gamma})
    ours = objective.weight(t, objective.schedule_buffers())
    torch.testing.assert_close(ours, expected.float(), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("spelling", ["objective.min_snr_gamma=5.0", "min_snr_gamma=5.0"])
def test_the_training_loss_is_weighted_by_min_snr(tiny_config, spelling):
    """Both spellings of the config reach the loss `training_step` takes: per sample, the MSE
    of the prediction times diffusers' weight."""
    model = tiny_model(tiny_config, spelling).train()
    batch = {"latent": torch.randn(3, 4, 8, 8), "caption": ["a", "b", "c"]}
    t = torch.tensor([3, 400, 950])  # SNR above, near and below 5
    noise = torch.randn(3, 4, 8, 8)
    cond = model.conditioning(batch)
    weighted = model.loss_at(batch["latent"], cond, t, noise, batch)

    x_t = model.objective.noised(batch["latent"], noise, t, model.schedule)
    with torch.no_grad():
        mse = (model.apply_model(x_t, t, cond) - noise).pow(2).mean(dim=(1, 2, 3))
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    snr = compute_snr(scheduler, t)
    torch.testing.assert_close(weighted.detach(), mse * snr.clamp(max=5.0) / snr, rtol=1e-4, atol=0)


# --- LR schedules: WarmupScheduler against diffusers' get_scheduler and torch --------------------


def diffusers_multipliers(name: str, warmup: int, total: int, steps: int) -> list[float]:
    """The multiplier diffusers' get_scheduler applies at each optimizer step 0..steps-1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize(
    "kind, diffusers_name",
    [("cosine", "cosine"), ("linear", "linear"), ("constant", "constant_with_warmup")],
)
def test_warmup_scheduler_is_diffusers_shifted_by_one_warmup_step(kind, diffusers_name):
    """docs/configs.md: step k < W gets (k + 1) / W (the first step lr / W, step W - 1 the full
    lr: no step spent at lr 0); from step W to total_steps, diffusers' decay exactly; after it
    the floor (diffusers' cosine would rise again)."""
    warmup, total = 5, 25
    ours = WarmupScheduler(kind, warmup_steps=warmup, total_steps=total)
    theirs = diffusers_multipliers(diffusers_name, warmup, total, total + 3)
    assert ours(0) == pytest.approx(1 / warmup) and ours(warmup - 1) == 1.0
    for k in range(warmup):
        assert ours(k) == pytest.approx(theirs[k + 1] if k + 1 < warmup else 1.0), k
    for k in range(warmup, total + 1):
        assert ours(k) == pytest.approx(theirs[k], abs=1e-12), k
    assert ours(total + 2) == (1.0 if kind == "constant" else 0.0)


def test_cosine_min_factor_is_torch_cosine_annealing_eta_min():
    warmup, total, base, floor = 3, 23, 2.0, 0.1
    ours = WarmupScheduler("cosine", warmup_steps=warmup, total_steps=total, min_factor=floor)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    torch_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=total - warmup, eta_min=floor * base
    )
    for k in range(warmup, total + 1):
        assert base * ours(k) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9), k
        optimizer.step()
        torch_scheduler.step()
    assert ours(total + 50) == pytest.approx(floor)


# --- caption / class dropout for classifier-free guidance (ucg_rate) ----------------------------


def recording(embedder):
    """Replace the embedder's forward by one that records its inputs and returns zeros."""
    seen = []

    def forward(inputs):
        seen.extend(list(inputs))
        return torch.zeros(len(inputs), 77, 32)

    embedder.forward = forward
    return seen


def test_ucg_rate_half_empties_about_half_the_captions(tiny_config):
    model = tiny_model(tiny_config, "cond_stage_config.params.ucg_rate=0.5").train()
    seen = recording(model.conditioner)
    captions = [f"caption {i}" for i in range(400)]
    model.conditioning({"caption": captions}, torch.Generator().manual_seed(0), drop=True)
    empty = sum(text == "" for text in seen)
    assert len(seen) == 400 and abs(empty - 200) <= 4 * math.sqrt(400 * 0.25), empty
    # The others are the captions themselves, in place.
    assert all(text in ("", f"caption {i}") for i, text in enumerate(seen))


def test_ucg_rate_applies_in_training_steps_only(tiny_config):
    """`diffusion_loss` (what training_step calls) drops in train mode, never in eval mode."""
    model = tiny_model(tiny_config, "ucg_rate=1.0")  # the original flat spelling
    seen = recording(model.conditioner)
    batch = {"latent": torch.randn(2, 4, 8, 8), "caption": ["a cat", "a dog"]}
    model.train().diffusion_loss(batch)
    assert seen == ["", ""]
    seen.clear()
    with torch.no_grad():
        model.eval().diffusion_loss(batch)
    assert seen == ["a cat", "a dog"]


def test_ucg_rate_drops_cached_text_outputs_too(tiny_config):
    """Trained from a latent cache (scripts/cache_latents.py), the captions' encoder outputs come
    with the batch: a dropped row is the empty caption's output instead."""
    model = tiny_model(tiny_config, "cond_stage_config.params.ucg_rate=0.5").train()
    seen = recording(model.conditioner)  # the null output: zeros
    cached = torch.ones(400, 77, 32)
    batch = {"caption": [f"c{i}" for i in range(400)], "context": {"crossattn": cached}}
    out = model.conditioning(batch, torch.Generator().manual_seed(0), drop=True)["crossattn"]
    nulled = (out == 0).flatten(1).all(dim=1)
    assert ((out == 1).flatten(1).all(dim=1) | nulled).all()
    assert abs(nulled.sum().item() - 200) <= 4 * math.sqrt(400 * 0.25), nulled.sum()
    assert seen == [""]  # the null output, computed once


def test_class_dropout_gives_the_null_class_at_the_rate():
    labels = ClassLabels(num_classes=10, ucg_rate=0.25)
    seen = []
    labels.forward = lambda inputs: seen.append(inputs.clone()) or torch.zeros(len(inputs), 8)
    inputs = torch.arange(1000) % 10
    labels.condition({"label": inputs}, torch.Generator().manual_seed(1), drop=True)
    null = (seen[0] == 10).sum().item()  # the extra row of the table
    assert abs(null - 250) <= 4 * math.sqrt(1000 * 0.25 * 0.75), null
    kept = seen[0] != 10
    assert torch.equal(seen[0][kept], inputs[kept])


# --- offset noise and the flow's time sampling, as the built model draws them -------------------


@pytest.mark.parametrize("spelling", ["objective.offset_noise", "offset_noise"])
def test_offset_noise_shifts_each_channels_mean_by_the_set_strength(tiny_config, spelling):
    """Guttenberg 2023: noise + s * N(0, 1) per sample and channel, so a channel's spatial mean has
    variance s^2 + 1 / (h w) instead of 1 / (h w); the pixels stay unit Gaussians around it."""
    model = tiny_model(tiny_config, f"{spelling}=0.1")
    z = torch.zeros(2000, 4, 16, 16)
    noise = model.objective.draw_noise(z, torch.Generator().manual_seed(0))
    means = noise.mean(dim=(2, 3))
    assert means.var().item() == pytest.approx(0.1**2 + 1 / 256, rel=0.05)
    assert (noise - means[..., None, None]).var().item() == pytest.approx(1 - 1 / 256, rel=0.01)
    plain = tiny_model(tiny_config).objective.draw_noise(z, torch.Generator().manual_seed(0))
    assert plain.mean(dim=(2, 3)).var().item() == pytest.approx(1 / 256, rel=0.05)


@pytest.mark.parametrize(
    "schedule, median",
    [
        # logit-normal(m, s): the median of sigmoid(N(m, s)) is sigmoid(m) (eq. 19) ...
        ({"logit_mean": 0.5}, 1 / (1 + math.exp(-0.5))),
        # ... then shifted: t' = 3 t / (1 + 2 t) at t = 1/2 is 3/4 (sec. 5.3.2)
        ({"shift": 3.0}, 0.75),
        ({"timestep_sampling": "mode", "mode_scale": 1.29}, 0.5),
    ],
)
def test_flow_config_times_have_the_papers_median(tiny_config, schedule, median):
    """The config's `objective.schedule` keys reach the times training draws (backbone units:
    t * 1000)."""
    keys = [f"objective.schedule.{key}={value}" for key, value in schedule.items()]
    model = tiny_model(tiny_config, "parameterization=flow", *keys)
    t = model.objective.sample_t(20_000, torch.Generator().manual_seed(0)) / 1000
    assert t.median().item() == pytest.approx(median, abs=0.01)


# --- the image logger's samples: the seed fixes them ----------------------------------------------


def test_log_images_samples_are_fixed_by_the_seed(tiny_config):
    model = tiny_model(tiny_config).eval()

    def grid(seed):
        with torch.no_grad():
            return model.log_images(None, N=2, prompts=["a", "b"], seed=seed, steps=2)["samples"]

    torch.manual_seed(1)
    first = grid(3)
    torch.manual_seed(2)  # the global stream plays no part
    assert torch.equal(grid(3), first)
    assert not torch.equal(grid(4), first)


# --- --scale_lr ----------------------------------------------------------------------------------


def test_scale_lr_multiplies_accumulation_devices_nodes_and_batch():
    """docs/training.md: lr = accumulate x devices x nodes x batch x base_learning_rate."""
    from types import SimpleNamespace

    from main import scaled_learning_rate

    data = SimpleNamespace(batch_size=lambda split: 3)
    trainer = SimpleNamespace(accumulate_grad_batches=2, num_devices=4, num_nodes=5)
    assert scaled_learning_rate(1e-6, data, trainer) == pytest.approx(2 * 4 * 5 * 3 * 1e-6)


def test_sdxl_caption_dropout_zeroes_both_text_encoders_together():
    """docs/sdxl.md, ldm/conditioning_xl.py: the caption is dropped once per sample for both
    text encoders (sgm: their outputs times 0), the size conditioning never."""
    sdxl = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "sdxl.yaml"
    model = tiny_model(sdxl, "conditioner_config.params.ucg_rate=0.5").train()
    n = 200
    batch = {
        "caption": [f"c{i}" for i in range(n)],
        "original_size_as_tuple": torch.full((n, 2), 32),
        "crop_coords_top_left": torch.zeros(n, 2, dtype=torch.long),
        "target_size_as_tuple": torch.full((n, 2), 32),
    }
    with torch.no_grad():
        cond = model.conditioning(batch, torch.Generator().manual_seed(0), drop=True)
    clip_l, big_g = cond["crossattn"][..., :32], cond["crossattn"][..., 32:]
    zero_l, zero_g = (clip_l == 0).flatten(1).all(1), (big_g == 0).flatten(1).all(1)
    assert torch.equal(zero_l, zero_g)
    assert abs(zero_l.sum().item() - n / 2) <= 4 * math.sqrt(n / 4), zero_l.sum()
    sizes = cond["vector"][:, -3 * 8 :]  # the three size embeddings, after the pooled text
    assert (sizes != 0).flatten(1).any(1).all()


def test_sd3_drops_each_encoder_independently_at_0_463(monkeypatch):
    """docs/sd3.md, paper sec. 5.3.3: CLIP-L, bigG and T5 each dropped with probability 0.463,
    independently, so all three together ~0.463^3 = 10 % of the time."""
    import ldm.conditioning_sd3 as sd3

    sd3_tiny = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "tiny.yaml"
    model = tiny_model(sd3_tiny).train()
    masks, zero_rows = [], sd3.zero_rows

    def recording_zero_rows(x, dropped):
        masks.append(dropped)
        return zero_rows(x, dropped)

    monkeypatch.setattr(sd3, "zero_rows", recording_zero_rows)
    n = 2000
    with torch.no_grad():
        cond = model.conditioning({"caption": ["c"] * n}, torch.Generator().manual_seed(0), True)
    per_encoder = [masks[0], masks[2], masks[4]]  # clip_l (tokens, pooled), clip_g (...), t5
    assert all(torch.equal(masks[i], masks[i + 1]) for i in (0, 2))  # one draw per encoder
    for dropped in per_encoder:
        assert abs(dropped.float().mean().item() - 0.463) < 0.04
    all_three = (per_encoder[0] & per_encoder[1] & per_encoder[2]).float().mean().item()
    assert abs(all_three - 0.463**3) < 0.025
    assert ((cond["vector"] == 0).all(1) == (per_encoder[0] & per_encoder[1])).all()
