"""The SD 3/3.5 VAE (16 latent channels, no quant_conv): Stability's key layout, diffusers' own
converter and model, both directions of the diffusers folder.

The references are not our code: the key list of Stability's `sd3_impls.SDVAE`
(tests/reference/sd3_vae_keys.json), diffusers' `convert_ldm_vae_checkpoint` (what its
`AutoencoderKL.from_single_file` runs on an SD3 file) and diffusers' `AutoencoderKL` with the
config of stabilityai/stable-diffusion-3.5-medium's `vae/config.json`, written out here.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ldm.autoencoder import AutoencoderKL
from ldm.layout import diffusers_vae, family

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = json.loads((ROOT / "tests" / "reference" / "sd3_vae_keys.json").read_text())
PREFIX = "first_stage_model."
# diffusers' SD 3/3.5 VAE config (the hub's vae/config.json of the SD3 pipelines), in its words.
SD3_DIFFUSERS = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
    layers_per_block=2, act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024,
    scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    force_upcast=True,
)  # fmt: skip
TINY_DD = dict(
    double_z=True, z_channels=16, resolution=32, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
    num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
TINY_DIFFUSERS = {
    **SD3_DIFFUSERS,
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "sample_size": 32,
}


def full_size_vae() -> AutoencoderKL:
    """configs/sd3/vae-finetune.yaml's VAE, frozen, on the meta device (no memory)."""
    params = OmegaConf.to_container(
        OmegaConf.load(ROOT / "configs" / "sd3" / "vae-finetune.yaml").model.params
    )
    with torch.device("meta"):
        return AutoencoderKL(
            params["ddconfig"], params["embed_dim"], use_quant_conv=params["use_quant_conv"]
        )


def tiny_sd3_vae(seed: int = 0) -> AutoencoderKL:
    """Every weight random and non-zero (GroupNorm affines and biases too)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(TINY_DD, 16, use_quant_conv=False)
    with torch.no_grad():
        for param in vae.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return vae.eval()


def test_the_full_size_state_dict_is_stabilitys_sd3_vae():
    ours = {PREFIX + k: list(v.shape) for k, v in full_size_vae().state_dict().items()}
    assert ours == REFERENCE["keys"]
    assert sum(v.numel() for v in full_size_vae().parameters()) == REFERENCE["parameter_count"]


@pytest.mark.slow  # imports diffusers
def test_diffusers_converter_loads_the_full_size_sd3_vae_with_no_key_left():
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    ours = {PREFIX + k: v for k, v in full_size_vae().state_dict().items()}
    converted = convert_ldm_vae_checkpoint(ours, SD3_DIFFUSERS)
    assert len(converted) == len(ours)  # every one of our tensors has a diffusers name
    with torch.device("meta"):
        theirs = DiffusersAutoencoderKL(**SD3_DIFFUSERS)
    result = theirs.load_state_dict(converted, strict=False, assign=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    shapes = {k: v.shape for k, v in theirs.state_dict().items()}
    assert {k: v.shape for k, v in converted.items()} == shapes


def diffusers_twin(vae: AutoencoderKL):
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    state = {PREFIX + k: v for k, v in vae.state_dict().items()}
    theirs = DiffusersAutoencoderKL(**TINY_DIFFUSERS).eval()
    theirs.load_state_dict(convert_ldm_vae_checkpoint(state, TINY_DIFFUSERS), strict=True)
    return theirs


def assert_same_vae(ours: AutoencoderKL, theirs) -> None:
    image = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latent = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine, their = ours.encode(image), theirs.encode(image).latent_dist
        assert mine.mean.shape == (2, 16, 16, 16)
        torch.testing.assert_close(mine.mean, their.mean)
        torch.testing.assert_close(mine.logvar, their.logvar)
        torch.testing.assert_close(ours.decode(latent), theirs.decode(latent).sample)


@pytest.mark.slow  # imports diffusers
def test_encode_and_decode_match_diffusers_sd3_vae():
    ours = tiny_sd3_vae()
    assert_same_vae(ours, diffusers_twin(ours))


@pytest.mark.slow  # imports diffusers
def test_the_latent_sd3_diffuses_is_the_paper_formula(tmp_path):
    """SD3's latent is (mean - 0.0609) * 1.5305 (sd3_impls.SD3LatentFormat.process_in), and
    diffusers' SD3 pipeline reads both numbers from the VAE folder's config we write."""
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL
    from swap_vae import main as swap_vae

    ours = tiny_sd3_vae()
    weights = tmp_path / "vae.safetensors"
    from ldm.checkpoint import save_safetensors

    save_safetensors(ours.state_dict(), weights)
    folder = tmp_path / "diffusers"
    argv = ["--vae", weights, "--to-diffusers", folder, "--size", "32"]
    assert swap_vae([str(a) for a in argv + ["--scaling-factor", "1.5305"]]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["shift_factor"] is None  # not given: no shift (diffusers' null)
    argv += ["--scaling-factor", "1.5305", "--shift-factor", "0.0609"]
    assert swap_vae([str(a) for a in argv]) == 0
    theirs = DiffusersAutoencoderKL.from_pretrained(folder).eval()
    for key, value in TINY_DIFFUSERS.items():
        expected = list(value) if isinstance(value, list) else value
        assert (list(theirs.config[key]) if isinstance(value, list) else theirs.config[key]) == (
            expected
        ), key
    assert_same_vae(ours, theirs)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        mean = ours.encode(image).mean
        pipeline = (theirs.encode(image).latent_dist.mean - theirs.config.shift_factor) * (
            theirs.config.scaling_factor
        )
    torch.testing.assert_close(pipeline, (mean - 0.0609) * 1.5305)


def test_a_16_channel_vae_needs_its_scaling_factor_for_diffusers(tmp_path, capsys):
    from swap_vae import main as swap_vae

    from ldm.checkpoint import save_safetensors

    save_safetensors(tiny_sd3_vae().state_dict(), tmp_path / "vae.safetensors")
    argv = ["--vae", str(tmp_path / "vae.safetensors"), "--to-diffusers", str(tmp_path / "out")]
    assert swap_vae(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "16-channel" in line and "--scaling-factor 1.5305 --shift-factor 0.0609" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # imports diffusers
def test_the_diffusers_folder_layout_is_bit_exact_both_ways():
    """Ours -> diffusers names -> ours: every tensor identical, none added or lost (no
    quant_conv appears); diffusers' own state dict of the same weights reads back the same."""
    ours = tiny_sd3_vae().state_dict()
    there = diffusers_vae.to_diffusers(ours)
    assert not any("quant_conv" in k for k in there)
    back = diffusers_vae.from_diffusers(there)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    theirs = diffusers_twin(tiny_sd3_vae()).state_dict()
    assert there.keys() == theirs.keys()
    assert all(torch.equal(there[k], theirs[k]) for k in theirs)
    from_theirs = diffusers_vae.from_diffusers(theirs)
    assert all(torch.equal(from_theirs[k], ours[k]) for k in ours)


def test_the_diffusers_config_of_sd3_weights_is_diffusers_sd3_config():
    full = {k: v for k, v in full_size_vae().state_dict().items()}
    config = diffusers_vae.diffusers_config(full, 1.5305, 1024, shift_factor=0.0609)
    for key, value in SD3_DIFFUSERS.items():
        if key != "force_upcast":
            assert config[key] == value, key


@pytest.mark.parametrize(
    "params, message",
    [
        ({"embed_dim": 4}, "embed_dim=4"),
        ({"embed_dim": 16, "use_quant_conv": True}, None),
    ],
)
def test_without_quant_conv_the_latent_is_z_channels(params, message):
    if message is None:
        vae = AutoencoderKL(TINY_DD, **params)
        assert vae.quant_conv.weight.shape == (32, 32, 1, 1)
        return
    with pytest.raises(ValueError, match=message):
        AutoencoderKL(TINY_DD, use_quant_conv=False, **params)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sd_v1_keys", family.VAE4),
        ("sd_v2_base_keys", family.VAE4),
        ("sdxl_base_keys", family.VAE4),
        ("sd3_vae_keys", family.VAE16),
        ("dit_xl2_256_keys", None),
    ],
)
def test_the_released_files_vae_kind(name, kind):
    keys = json.loads((ROOT / "tests" / "reference" / f"{name}.json").read_text())["keys"]
    assert family.vae_kind(keys) == kind
    if kind is not None:  # a VAE file alone (bare names) and its diffusers names: the same kind
        bare = {k.removeprefix(PREFIX): v for k, v in keys.items() if k.startswith(PREFIX)}
        assert family.vae_kind(bare) == kind
        shapes = {k: torch.empty(v, device="meta") for k, v in bare.items()}
        assert family.vae_kind(diffusers_vae.to_diffusers(shapes)) == kind


@pytest.mark.parametrize("vae_kind, model_kind", [("sd3", "sd"), ("sd", "sd3")])
def test_swap_vae_refuses_the_other_kind_in_one_line(tmp_path, capsys, vae_kind, model_kind):
    from swap_vae import main as swap_vae

    from ldm.checkpoint import save_safetensors

    def vae(kind):
        torch.manual_seed(0)
        dd = TINY_DD if kind == "sd3" else {**TINY_DD, "z_channels": 4}
        return AutoencoderKL(dd, dd["z_channels"], use_quant_conv=kind == "sd").state_dict()

    save_safetensors(vae(vae_kind), tmp_path / "vae.safetensors")
    model = {PREFIX + k: v for k, v in vae(model_kind).items()}
    save_safetensors(
        {**model, "model.diffusion_model.x": torch.zeros(1)}, tmp_path / "m.safetensors"
    )
    argv = ["--vae", tmp_path / "vae.safetensors", "--ckpt", tmp_path / "m.safetensors"]
    assert swap_vae([str(a) for a in argv + ["--out", tmp_path / "out.safetensors"]]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    found = family.VAE16 if vae_kind == "sd3" else family.VAE4
    assert f"--vae holds {found}" in line and str(tmp_path / "m.safetensors") in line
    assert not (tmp_path / "out.safetensors").exists()


def test_a_first_stage_of_the_other_kind_is_named_before_loading(tmp_path):
    """An SD config's first stage given SD3's VAE file (first_stage_config.params.ckpt_path)."""
    from ldm.checkpoint import WrongFileError, save_safetensors

    save_safetensors(tiny_sd3_vae().state_dict(), tmp_path / "sd3_vae.safetensors")
    with pytest.raises(WrongFileError) as err:
        AutoencoderKL({**TINY_DD, "z_channels": 4}, 4, ckpt_path=tmp_path / "sd3_vae.safetensors")
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"first_stage_config.params.ckpt_path {tmp_path}/sd3_vae.safetensors")
    assert f"holds {family.VAE16}, but the config builds {family.VAE4}" in line
    AutoencoderKL(TINY_DD, 16, use_quant_conv=False, ckpt_path=tmp_path / "sd3_vae.safetensors")
