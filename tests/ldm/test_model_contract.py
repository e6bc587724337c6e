"""The batch contract (`ldm.model_contract.TrainingBatch`): what the data hands the step.

`loss_weight` weighs each sample's loss, as DreamBooth's prior preservation does (diffusers'
train_dreambooth.py: loss = instance loss + prior_loss_weight * prior loss, i.e. each class
image's loss times the weight); a cached `latent` (posterior moments) stands for the image it was
encoded from, with the same posterior draw from the same generator.
"""

import torch

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container


def tiny(tiny_config):
    torch.manual_seed(0)
    return instantiate_from_config(to_container(merge_configs([tiny_config]))["model"]).eval()


def batch():
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(3, 3, 32, 32, generator=generator) * 2 - 1
    return {"image": images, "caption": ["a red circle", "a blue square", "a green triangle"]}


def test_each_samples_loss_is_times_its_loss_weight_and_a_cached_latent_is_its_image(tiny_config):
    model = tiny(tiny_config)
    plain = batch()
    weights = torch.tensor([1.0, 0.4, 0.0])  # an instance image, a class image, one left out
    _, per_sample, t = model.diffusion_loss(plain, torch.Generator().manual_seed(2))
    weighted = {**plain, "loss_weight": weights}
    _, per_weighted, t2 = model.diffusion_loss(weighted, torch.Generator().manual_seed(2))
    assert torch.equal(t, t2)
    torch.testing.assert_close(per_weighted, per_sample * weights)

    vae = model.first_stage_model
    with torch.no_grad():
        moments = vae.quant_conv(vae.encoder(plain["image"]))  # what a latent cache stores
    cached = {"latent": moments, "caption": plain["caption"]}
    _, per_cached, t3 = model.diffusion_loss(cached, torch.Generator().manual_seed(2))
    assert torch.equal(t, t3)
    torch.testing.assert_close(per_cached, per_sample)
