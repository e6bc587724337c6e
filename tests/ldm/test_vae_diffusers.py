"""A VAE trained here, in diffusers' own loaders: swap_vae.py's file through
`AutoencoderKL.from_single_file` (diffusers' key conversion, a config written by diffusers), and
its `--to-diffusers` folder through `AutoencoderKL.from_pretrained`; both decode as ours does."""

import pytest
from swap_vae import main as swap_vae
from vae_helpers import DDCONFIG, DIFFUSERS_CONFIG, assert_decodes_like, trained  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # imports diffusers


def test_swap_vae_file_loads_in_diffusers_single_file_loader(tmp_path, trained):  # noqa: F811
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL

    path, ours = trained
    out = tmp_path / "myvae.safetensors"
    assert swap_vae(["--vae", str(path), "--out", str(out)]) == 0
    DiffusersAutoencoderKL(**DIFFUSERS_CONFIG).save_config(tmp_path / "config")
    theirs = DiffusersAutoencoderKL.from_single_file(
        str(out), config=str(tmp_path / "config"), local_files_only=True
    )
    assert_decodes_like(ours, theirs.eval())


def test_to_diffusers_folder_loads_with_from_pretrained(tmp_path, trained):  # noqa: F811
    from diffusers import AutoencoderKL as DiffusersAutoencoderKL

    path, ours = trained
    folder = tmp_path / "myvae"
    assert swap_vae(["--vae", str(path), "--to-diffusers", str(folder), "--size", "32"]) == 0
    theirs = DiffusersAutoencoderKL.from_pretrained(folder).eval()
    for key, value in DIFFUSERS_CONFIG.items():
        assert (
            list(theirs.config[key]) == value
            if isinstance(value, list)
            else theirs.config[key] == value
        )
    assert theirs.config["scaling_factor"] == 0.18215
    assert_decodes_like(ours, theirs)
