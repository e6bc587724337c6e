"""AutoencoderKL: original checkpoint layout, numerical parity with diffusers, posterior API."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm.autoencoder import AutoencoderKL, DiagonalGaussianDistribution, IdentityFirstStage
from ldm.util import instantiate_from_config

REFERENCE = Path(__file__).resolve().parents[1] / "reference"
PREFIX = "first_stage_model."

TINY_DDCONFIG = {
    "double_z": True,
    "z_channels": 4,
    "resolution": 32,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 32,  # GroupNorm(32) needs multiples of 32
    "ch_mult": [1, 2],
    "num_res_blocks": 1,
    "attn_resolutions": [],
    "dropout": 0.0,
}


def tiny_vae(seed: int = 0) -> AutoencoderKL:
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        ddconfig=TINY_DDCONFIG, embed_dim=4, lossconfig={"target": "torch.nn.Identity"}
    )
    # Default inits leave GroupNorm affine at 1/0; perturb them so a swapped scale/shift shows.
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return vae.eval()


@pytest.mark.parametrize(
    "config_file, keys_file",
    [("v1-inference.yaml", "sd_v1_keys.json"), ("v2-inference.yaml", "sd_v2_base_keys.json")],
)
def test_full_size_state_dict_matches_original_checkpoint(config_file, keys_file):
    config = OmegaConf.load(
        REFERENCE.parents[1] / "configs" / "stable-diffusion" / config_file
    ).model.params.first_stage_config
    with torch.device("meta"):
        vae = instantiate_from_config(config)  # original target path, params unchanged
    assert isinstance(vae, AutoencoderKL)
    reference = json.loads((REFERENCE / keys_file).read_text())["keys"]
    expected = {k[len(PREFIX) :]: shape for k, shape in reference.items() if k.startswith(PREFIX)}
    ours = {k: list(v.shape) for k, v in vae.state_dict().items()}
    assert sorted(ours) == sorted(expected)
    assert ours == expected
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863


def test_encode_decode_match_diffusers():
    single_file_utils = pytest.importorskip("diffusers.loaders.single_file_utils")
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL

    vae = tiny_vae()
    original_config = {
        "model": {
            "params": {
                "scale_factor": 0.18215,
                "first_stage_config": {"params": {"ddconfig": TINY_DDCONFIG, "embed_dim": 4}},
            }
        }
    }
    checkpoint = {PREFIX + k: v for k, v in vae.state_dict().items()}
    config = single_file_utils.create_vae_diffusers_config_from_ldm(original_config, checkpoint)
    converted = single_file_utils.convert_ldm_vae_checkpoint(checkpoint, config)
    reference = DiffusersAutoencoderKL(**config).eval()
    reference.load_state_dict(converted, strict=True)

    image = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latent = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = vae.encode(image)
        theirs = reference.encode(image).latent_dist
        assert ours.mean.shape == (2, 4, 16, 16)
        torch.testing.assert_close(ours.mean, theirs.mean)
        torch.testing.assert_close(ours.logvar, theirs.logvar)
        torch.testing.assert_close(ours.std, theirs.std)
        decoded = vae.decode(latent)
        assert decoded.shape == (2, 3, 32, 32)
        torch.testing.assert_close(decoded, reference.decode(latent).sample)


def test_posterior_sampling_is_seeded_and_reparameterised():
    moments = torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(0))
    posterior = DiagonalGaussianDistribution(moments)
    first = posterior.sample(torch.Generator().manual_seed(7))
    second = posterior.sample(torch.Generator().manual_seed(7))
    torch.testing.assert_close(first, second)
    assert not torch.equal(first, posterior.sample(torch.Generator().manual_seed(8)))
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(first, moments[:, :4] + torch.exp(0.5 * moments[:, 4:]) * noise)
    assert torch.equal(posterior.mode(), moments[:, :4])


def test_logvar_is_clamped_like_the_original():
    moments = torch.cat([torch.zeros(1, 4, 2, 2), torch.full((1, 4, 2, 2), 100.0)], dim=1)
    assert torch.all(DiagonalGaussianDistribution(moments).logvar == 20.0)
    moments[:, 4:] = -100.0
    posterior = DiagonalGaussianDistribution(moments)
    assert torch.all(posterior.logvar == -30.0)
    torch.testing.assert_close(
        posterior.std, torch.full((1, 4, 2, 2), torch.exp(torch.tensor(-15.0)).item())
    )


def test_forward_reconstructs_with_posterior():
    vae = tiny_vae()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        reconstruction, posterior = vae(image, sample_posterior=False)
        torch.testing.assert_close(reconstruction, vae.decode(posterior.mode()))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lossconfig": {"target": "ldm.modules.losses.LPIPSWithDiscriminator"}}, "lossconfig"),
        ({"ddconfig": {**TINY_DDCONFIG, "chanels": 3}}, "chanels"),
        ({"ddconfig": {**TINY_DDCONFIG, "double_z": False}}, "double_z"),
        ({"ddconfig": {**TINY_DDCONFIG, "attn_type": "linear"}}, "attn_type"),
        ({"ddconfig": {**TINY_DDCONFIG, "ch": 48}}, "multiple of 32"),
        ({"ddconfig": {k: v for k, v in TINY_DDCONFIG.items() if k != "z_channels"}}, "z_channels"),
    ],
)
def test_bad_config_names_the_key(change, message):
    params = {"ddconfig": TINY_DDCONFIG, "embed_dim": 4, **change}
    with pytest.raises(ValueError, match=message):
        AutoencoderKL(**params)


def test_ckpt_path_loads_vae_from_a_full_checkpoint(tmp_path):
    from safetensors.torch import save_file

    # Our own module (ckpt_path= loads through it), not an optional one: broken fails, never skips.
    import ldm.checkpoint  # noqa: F401

    source = tiny_vae(seed=1)
    state = {PREFIX + k: v.contiguous() for k, v in source.state_dict().items()}
    state["model.diffusion_model.out.0.weight"] = torch.zeros(3)  # other parts are skipped
    save_file(state, tmp_path / "model.safetensors")
    loaded = AutoencoderKL(TINY_DDCONFIG, 4, ckpt_path=str(tmp_path / "model.safetensors"))
    for name, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    del state[PREFIX + "quant_conv.weight"]
    save_file(state, tmp_path / "broken.safetensors")
    with pytest.raises(KeyError, match="missing"):
        AutoencoderKL(TINY_DDCONFIG, 4, ckpt_path=str(tmp_path / "broken.safetensors"))


def test_identity_first_stage_passes_through():
    stage = instantiate_from_config({"target": "ldm.models.autoencoder.IdentityFirstStage"})
    assert isinstance(stage, IdentityFirstStage)
    assert len(stage.state_dict()) == 0
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    posterior = stage.encode(x)
    assert posterior.sample(torch.Generator().manual_seed(1)) is x
    assert posterior.mode() is x
    assert stage.decode(x) is x
