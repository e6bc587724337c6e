"""Diffusers folders read in the original layout (ldm.layout.diffusers).

The rules are checked against diffusers' own code, never ours on both sides: SD 1.x / 2.x folders
are written by our `--to-diffusers` export, which runs diffusers' single-file converters; SDXL
folders are written by diffusers / transformers themselves and our result is converted back by
diffusers' converters and compared tensor by tensor.
"""

import json
from pathlib import Path

import convert
import pytest
import torch

from ldm import checkpoint
from ldm.layout import diffusers as diffusers_layout
from ldm.layout.diffusers import DiffusersFolderError
from ldm.safe_load import UnsafeCheckpointError
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

diffusers = pytest.importorskip("diffusers")
from diffusers.loaders import single_file_utils as sfu  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1] / "reference"
TINY_OPENCLIP = {"width": 32, "layers": 3, "heads": 2, "embed_dim": 16}


def family_config(tiny_config: Path, family: str) -> dict:
    """The tiny model config: SD 1.x (CLIP, eps) or SD 2.x (OpenCLIP tower, v-prediction)."""
    config = to_container(merge_configs([tiny_config]))
    if family == "sd2":
        params = config["model"]["params"]
        params["parameterization"] = "v"
        params["cond_stage_config"] = {
            "target": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
            "params": TINY_OPENCLIP,
        }
    return config


def randomized(model: torch.nn.Module, seed: int) -> dict:
    """The model's state dict with every float weight redrawn: no zero-initialised layer (or
    the constant logit_scale) can hide a mapping mistake."""
    generator = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    for key, value in state.items():
        if value.is_floating_point() and key not in convert.full_precision():
            state[key] = torch.randn(value.shape, generator=generator)
    model.load_state_dict(state)
    return model.state_dict()


@pytest.fixture(scope="module", params=["sd1", "sd2"])
def exported(request, tmp_path_factory, tiny_config):
    """(family, config, original state, a folder written by our --to-diffusers export, a fresh
    model of the config to load it into)."""
    config = family_config(tiny_config, request.param)
    model = instantiate_from_config(config["model"])
    state = randomized(model, seed=1)
    folder = tmp_path_factory.mktemp(request.param) / "pipeline"
    convert.export_diffusers(dict(state), config, folder)
    return request.param, config, state, folder, instantiate_from_config(config["model"])


@pytest.mark.slow
def test_round_trip_through_our_export_is_bit_exact(exported):
    """original -> diffusers folder (diffusers' converters) -> original: every key diffusers
    stores comes back with the same bits, the schedule buffers too; the model loads strictly."""
    family, config, state, folder, model = exported
    back, info = diffusers_layout.original_state(folder)
    assert info.family == family
    assert info.parameterization == ("v" if family == "sd2" else "eps")
    # SD 2's tower in diffusers stops at the penultimate block (SD 2's conditioning); the last
    # block, text_projection and logit_scale have no place there and are filled on load.
    unstored = {"cond_stage_model.model.text_projection", "cond_stage_model.model.logit_scale"}
    unstored |= {
        k for k in state if k.startswith("cond_stage_model.model.transformer.resblocks.2.")
    }
    expected_keys = set(state) - unstored if family == "sd2" else set(state)
    assert set(back) == expected_keys
    for key in expected_keys:
        assert back[key].dtype == state[key].dtype, key
        assert torch.equal(back[key], state[key]), key

    checkpoint.load_weights(model, folder)  # strict
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in expected_keys)
    if family == "sd2":  # the filled block is an identity: the conditioning is unchanged
        original = instantiate_from_config(config["model"])
        original.load_state_dict(state)
        with torch.no_grad():
            want = original.conditioner(["a red circle"])
            assert torch.equal(model.conditioner(["a red circle"]), want)
            model.conditioner.layer = "last"
            assert torch.equal(model.conditioner(["a red circle"]), want)
            model.conditioner.layer = "penultimate"
        assert loaded["cond_stage_model.model.transformer.resblocks.2.mlp.c_fc.weight"].eq(0).all()


def test_folder_settings_must_match_the_config(exported, tiny_config, monkeypatch):
    """Prediction type, latent scale and family: a mismatch is one line naming the file."""
    family, config, state, folder, model = exported
    flipped = family_config(tiny_config, family)  # the other prediction type
    flipped["model"]["params"]["parameterization"] = "eps" if family == "sd2" else "v"
    with pytest.raises(DiffusersFolderError, match=r"scheduler_config.json: prediction_type"):
        checkpoint.load_weights(instantiate_from_config(flipped["model"]), folder)
    with monkeypatch.context() as patch:
        patch.setattr(model, "scale_factor", 0.13025)
        with pytest.raises(DiffusersFolderError, match=r"vae/config.json: scaling_factor 0.18215"):
            checkpoint.load_weights(model, folder)
    other = family_config(tiny_config, "sd1" if family == "sd2" else "sd2")
    other["model"]["params"]["parameterization"] = model.parameterization
    name, expected = ("SD 2.x", "SD 1.x") if family == "sd2" else ("SD 1.x", "SD 2.x")
    # the family detector (ldm.layout.family) answers before any weight is read
    with pytest.raises(
        checkpoint.WrongFileError,
        match=f"is a diffusers folder \\({name}\\), expected an {expected} checkpoint",
    ):
        checkpoint.load_weights(instantiate_from_config(other["model"]), folder)


def test_folder_errors_name_the_file(exported, tmp_path):
    """A missing component, a pickle holding code, an unknown family."""
    import shutil

    family, config, state, folder, model = exported
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "vae")
    with pytest.raises(DiffusersFolderError, match=r"copy/vae/config.json: missing"):
        checkpoint.load_weights(model, copy)
    shutil.copytree(folder / "vae", copy / "vae")

    weights = copy / "text_encoder" / "model.safetensors"
    state = checkpoint.load_file_state(weights)
    weights.unlink()
    torch.save({**state, "hook": Exploit()}, copy / "text_encoder" / "model.bin")
    with pytest.raises(UnsafeCheckpointError, match=r"text_encoder/model.bin: refused"):
        checkpoint.load_weights(model, copy)
    torch.save(state, copy / "text_encoder" / "model.bin")  # plain tensors: loads weights-only
    checkpoint.load_weights(model, copy)

    text_config = copy / "text_encoder" / "config.json"
    text_config.write_text(
        json.dumps({**json.loads(text_config.read_text()), "hidden_act": "relu"})
    )
    with pytest.raises(
        DiffusersFolderError, match=r"text_encoder/config.json: unknown model family"
    ):
        checkpoint.load_weights(model, copy)


class Exploit:
    """Stands for pickled code: a class outside the allow-list."""


# --- SDXL: folders written by diffusers, checked with diffusers' converters run back ----------
def tiny_sdxl_components():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4),
        cross_attention_dim=48,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16 + 6 * 8,
    )
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        scaling_factor=0.13025,
    )
    clip = dict(intermediate_size=64, num_attention_heads=2, max_position_embeddings=77)
    text = CLIPTextModel(
        CLIPTextConfig(hidden_size=16, num_hidden_layers=2, hidden_act="quick_gelu", **clip)
    )
    text_2 = CLIPTextModelWithProjection(
        CLIPTextConfig(
            hidden_size=32, num_hidden_layers=3, hidden_act="gelu", projection_dim=16, **clip
        )
    )
    parts = {"unet": unet, "vae": vae, "text_encoder": text, "text_encoder_2": text_2}
    for part in parts.values():  # every weight random, none zero-initialised
        randomized(part, seed=2)
    return parts


def flat_text_names(state: dict) -> dict:
    return {k.removeprefix("text_model."): v for k, v in state.items() if "position_ids" not in k}


def test_sdxl_folder_matches_diffusers_converters(tmp_path):
    """Bare component folders saved by diffusers / transformers; our original-layout state dict,
    turned back by diffusers' single-file converters, gives their tensors bit for bit."""
    parts = tiny_sdxl_components()
    for name, part in parts.items():
        part.save_pretrained(tmp_path / name)
    state, info = diffusers_layout.original_state(tmp_path)
    assert info.family == "sdxl" and info.scale_factor == 0.13025
    assert {k.split(".")[0] for k in state} == {"model", "first_stage_model", "conditioner"}

    unet = sfu.convert_ldm_unet_checkpoint(state, parts["unet"].config)
    vae = sfu.convert_ldm_vae_checkpoint(state, parts["vae"].config)
    text = sfu.convert_ldm_clip_checkpoint(state)
    text_2 = sfu.convert_open_clip_checkpoint(
        parts["text_encoder_2"], state, prefix="conditioner.embedders.1.model."
    )
    pairs = [
        (unet, parts["unet"].state_dict()),
        (vae, parts["vae"].state_dict()),
        (flat_text_names(text), flat_text_names(parts["text_encoder"].state_dict())),
        (flat_text_names(text_2), flat_text_names(parts["text_encoder_2"].state_dict())),
    ]
    for theirs, folder in pairs:
        assert set(theirs) == set(folder)
        for key, value in folder.items():
            assert torch.equal(theirs[key], value), key
    # Every key of ours was read by a converter: 1:1 renames, except each layer's packed
    # in_proj weight and bias, which are three tensors each in diffusers.
    assert sum(len(theirs) for theirs, _ in pairs) == len(state) + 3 * 2 * 2


SDXL_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "cross_attention_dim": 2048,
    "attention_head_dim": [5, 10, 20],
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "transformer_layers_per_block": [1, 2, 10],
}
SDXL_VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "latent_channels": 4,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12}
CLIP_L |= {"num_attention_heads": 12, "hidden_act": "quick_gelu", "projection_dim": 768}
CLIP_BIG_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32}
CLIP_BIG_G |= {"num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280}


def test_sdxl_full_size_keys_equal_the_reference():
    """SDXL 1.0's real component configs, built on the meta device: the converted names and
    shapes are exactly the released single file's (`sdxl_base_keys.json`), and each UNet key
    pairs with the diffusers name `sdxl_diffusers_unet_map.json` gives it."""
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**SDXL_UNET).state_dict()
        vae = diffusers.AutoencoderKL(**SDXL_VAE).state_dict()
        text = CLIPTextModel(CLIPTextConfig(**CLIP_L)).state_dict()
        text_2 = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_BIG_G)).state_dict()
    source = Path("folder")
    state = diffusers_layout.unet_to_original(unet, SDXL_UNET, source)
    state |= diffusers_layout.vae_to_original(vae, source)
    state |= diffusers_layout.clip_to_original(text, "conditioner.embedders.0.transformer.")
    state |= diffusers_layout.open_clip_to_original(
        text_2, "conditioner.embedders.1.model.", source
    )
    reference = json.loads((REFERENCE / "sdxl_base_keys.json").read_text())
    expected = {k: v for k, v in reference["keys"].items() if k not in reference["optional_keys"]}
    filled = diffusers_layout.fill_unstored(state, {k: torch.Size(v) for k, v in expected.items()})
    assert filled == ["conditioner.embedders.1.model.logit_scale"]
    assert {k: list(v.shape) for k, v in state.items()} == expected

    mapping = json.loads((REFERENCE / "sdxl_diffusers_unet_map.json").read_text())["map"]
    ours = {
        original: diffusers_name
        for diffusers_name, original in zip(
            unet, diffusers_layout.unet_to_original(dict.fromkeys(unet), SDXL_UNET, source)
        )
    }
    assert ours == mapping


SD_UNET = {
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
}
SD_VAE = {**SDXL_VAE, "scaling_factor": 0.18215, "sample_size": 512}
SD_FAMILIES = {  # (reference file, unet config, text config, text prefix)
    "sd1": (
        "sd_v1_keys.json",
        {**SD_UNET, "cross_attention_dim": 768, "attention_head_dim": 8},
        CLIP_L,
        "cond_stage_model.transformer.",
    ),
    "sd2": (
        "sd_v2_v_keys.json",
        {**SD_UNET, "cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20]}
        | {"use_linear_projection": True},
        # diffusers' stable-diffusion-2 text encoder: 23 of OpenCLIP ViT-H's 24 blocks
        {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 23}
        | {"num_attention_heads": 16, "hidden_act": "gelu", "projection_dim": 512},
        "cond_stage_model.model.",
    ),
}


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_sd_full_size_keys_equal_the_reference(family):
    """SD 1.5 and SD 2.1's real diffusers configs on the meta device: the converted weights
    have exactly the original checkpoints' names and shapes (position_ids is optional)."""
    reference, unet_config, text_config, prefix = SD_FAMILIES[family]
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**unet_config).state_dict()
        vae = diffusers.AutoencoderKL(**SD_VAE).state_dict()
        text = CLIPTextModel(CLIPTextConfig(**text_config)).state_dict()
    source = Path("folder")
    state = diffusers_layout.unet_to_original(unet, unet_config, source)
    state |= diffusers_layout.vae_to_original(vae, source)
    if family == "sd1":
        state |= diffusers_layout.clip_to_original(text, prefix)
    else:
        state |= diffusers_layout.open_clip_to_original(text, prefix, source)
    keys = json.loads((REFERENCE / reference).read_text())["keys"]
    expected = {k: v for k, v in keys.items() if "." in k and not k.endswith("position_ids")}
    filled = diffusers_layout.fill_unstored(state, {k: torch.Size(v) for k, v in expected.items()})
    if family == "sd2":  # block 23, text_projection, logit_scale
        assert len(filled) == 12 + 2
    assert {k: list(v.shape) for k, v in state.items()} == expected
