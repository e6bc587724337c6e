"""The fixed-noise validation loss (ldm/validation.py): the same figure for the same weights,
whatever the batch size, item order and global random state; buckets that average to the total."""

import random

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ldm.util import instantiate_from_config
from ldm.validation import ITEM_KEY, FixedNoiseValidation
from lun.config import merge_configs, to_container

CAPTIONS = ["a red circle", "a blue square", "a green triangle", "a red square"]
LATENT = (4, 8, 8)  # of the 16 x 16 test images (the tiny VAE halves the side)


@pytest.fixture(scope="module")
def model(tiny_config):
    torch.manual_seed(0)
    built = instantiate_from_config(to_container(merge_configs([tiny_config], []))["model"])
    return built.eval()


@pytest.fixture(scope="module")
def reference(model, items) -> dict[str, float]:
    """The figures of one pass in batches of 2, the global streams seeded with 1."""
    torch.manual_seed(1)
    return figures(model, items, batch_size=2)


@pytest.fixture(scope="module")
def items():
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(len(CAPTIONS), 3, 16, 16, generator=generator) * 2 - 1
    return [{"image": images[i], "caption": CAPTIONS[i], ITEM_KEY: i} for i in range(len(CAPTIONS))]


def batches(items, batch_size: int, order=None):
    order = range(len(items)) if order is None else order
    chosen = [items[i] for i in order]
    for start in range(0, len(chosen), batch_size):
        part = chosen[start : start + batch_size]
        yield {
            "image": torch.stack([item["image"] for item in part]),
            "caption": [item["caption"] for item in part],
            ITEM_KEY: torch.tensor([item[ITEM_KEY] for item in part]),
        }


def figures(model, items, batch_size: int, order=None) -> dict[str, float]:
    """One validation pass as Lightning runs it (one process)."""
    model.validation_loss.reset()
    for batch_idx, batch in enumerate(batches(items, batch_size, order)):
        model.validation_loss.step(model, batch, batch_idx)
    return model.validation_loss.finish(model)


def global_streams():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def test_same_figure_for_any_batch_size_item_order_and_global_seed(model, items, reference):
    torch.manual_seed(12345)
    before = global_streams()
    second = figures(model, items, batch_size=3, order=[3, 2, 0, 1])
    after = global_streams()
    # Validating draws nothing from the streams training uses (an exact resume stays exact).
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert np.array_equal(before[2], after[2])
    assert second.keys() == reference.keys()
    assert_close(second, reference, rtol=1e-5, atol=0)
    assert model.validation_loss.items == len(items)


def test_buckets_average_to_the_total_and_hold_their_timesteps(model, reference):
    result = reference
    buckets = [result[name] for name in model.validation_loss.names]
    assert model.validation_loss.names == [
        "val/loss_t0-249",
        "val/loss_t250-499",
        "val/loss_t500-749",
        "val/loss_t750-999",
    ]
    assert result["val/loss"] == pytest.approx(sum(buckets) / 4, rel=1e-12)
    assert len(set(buckets)) == 4  # four different figures, not one copied
    validation = model.validation_loss
    t = torch.stack([validation.draws(key, LATENT)[0] for key in range(200)])  # (200, 4)
    for b, (lo, hi) in enumerate(zip(validation.edges, validation.edges[1:])):
        assert lo <= int(t[:, b].min()) and int(t[:, b].max()) < hi
        assert int(t[:, b].max()) - int(t[:, b].min()) > (hi - lo) // 2  # spread over the bucket
    # Each item its own noise; the same item the same noise.
    noise = [validation.draws(key, LATENT)[1] for key in (0, 1, 0)]
    assert torch.equal(noise[0], noise[2]) and not torch.allclose(noise[0], noise[1])


def test_an_item_seen_twice_counts_once(model, items, reference):
    """As when a rank repeats a batch to match the others' count (DDP)."""
    model.validation_loss.reset()
    repeated = list(range(len(items))) + [0, 1]
    for batch_idx, batch in enumerate(batches(items, 3, repeated)):
        model.validation_loss.step(model, batch, batch_idx)
    assert_close(model.validation_loss.finish(model), reference, rtol=1e-5, atol=0)
    assert model.validation_loss.items == len(items)


def test_same_figure_after_training_steps_under_another_seed(model, items, reference):
    """Training draws t, noise and caption dropout from the global streams; with a learning rate
    of 0 the weights stay as they were, so the figure must not move - bit for bit."""
    torch.manual_seed(999)
    model.train()
    optimizer = torch.optim.SGD(model.model.parameters(), lr=0.0)
    for batch in batches(items, 2):
        loss, _, _ = model.diffusion_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert figures(model, items, batch_size=2) == reference


def test_validation_loss_is_the_training_objective_at_the_item_draws(model, items):
    """Against a direct computation with the model's own loss (eps MSE here) at item 3's draws."""
    validation = FixedNoiseValidation(model.num_timesteps)
    (batch,) = batches(items, 1, order=[3])
    validation.step(model, batch, 0)
    t, noise = validation.draws(3, LATENT)
    with torch.no_grad():
        z = model.first_stage_model.encode(batch["image"]).mode() * model.scale_factor
        cond = model.conditioning(batch)
        a = model.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1)
        s = model.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1)
        x_t = a * z + s * noise
        eps = model.apply_model(x_t, t, {k: v.expand(4, *v.shape[1:]) for k, v in cond.items()})
        expected = ((eps - noise) ** 2).mean(dim=(1, 2, 3))
    result = validation.finish(model)
    got = torch.tensor([result[name] for name in validation.names], dtype=torch.float32)
    assert_close(got, expected, rtol=1e-5, atol=1e-7)
