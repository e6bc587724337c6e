"""A VAE trained here with every weight random, and its comparison with diffusers' (shared by the
VAE interop tests)."""

import pytest
import torch

from ldm.autoencoder import AutoencoderKL
from ldm.autoencoder_training import autoencoder_kl

DDCONFIG = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32,
    ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
LOSS = {
    "target": "ldm.vae_loss.LPIPSWithDiscriminator",
    "params": {"disc_start": 0, "perceptual_weight": 0.0, "disc_ndf": 8, "disc_num_layers": 2},
}
# The same VAE in diffusers' words, written here (not read from our export).
DIFFUSERS_CONFIG = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
    latent_channels=4, norm_num_groups=32, sample_size=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training checkpoint of configs/autoencoder's module, every weight random (none zero)."""
    torch.manual_seed(0)
    module = autoencoder_kl(ddconfig=DDCONFIG, lossconfig=LOSS, embed_dim=4)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("vae") / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "global_step": 1}, path)
    ours = AutoencoderKL(DDCONFIG, 4, ckpt_path=str(path)).eval()
    return path, ours


def assert_decodes_like(ours, theirs):
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(ours.decode(z), theirs.decode(z).sample, atol=1e-5, rtol=1e-4)
        mean = theirs.encode(x).latent_dist.mean
        torch.testing.assert_close(ours.encode(x).mean, mean, atol=1e-5, rtol=1e-4)
