"""The SD3 model's state dict is Stability's single-file layout (ldm.layout.sd3), read by
diffusers' own single-file converters; conversion to and from diffusers' components is
bit-exact; a file of another family is one line (ldm.layout.family)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from sd3_helpers import t5_tokenizer_folder  # noqa: E402

from ldm.checkpoint import WrongFileError, check_family
from ldm.layout import family
from ldm.layout import sd3 as layout
from ldm.util import instantiate_from_config

single_file_utils = pytest.importorskip("diffusers.loaders.single_file_utils")
from diffusers import AutoencoderKL, SD3Transformer2DModel  # noqa: E402
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

from ldm.conditioning_sd3 import CLIP_G_TEXT_CONFIG  # noqa: E402
from ldm.text_encoder import CLIP_VIT_L14_TEXT_CONFIG  # noqa: E402
from ldm.text_encoder_t5 import T5_XXL_CONFIG  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "sd3" / "tiny.yaml"
FULL = {
    "sd35_medium": ROOT / "configs" / "sd3" / "sd3.5-medium-finetune.yaml",
    "sd35_large": ROOT / "configs" / "sd3" / "sd3.5-large-finetune.yaml",
}
# The diffusers configs of the released repositories (transformer/, vae/), as in test_mmdit.py.
TRANSFORMER_CONFIGS = {
    "sd35_medium": dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                        pos_embed_max_size=384, qk_norm="rms_norm",
                        dual_attention_layers=tuple(range(13))),
    "sd35_large": dict(num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                       pos_embed_max_size=192, qk_norm="rms_norm"),
}  # fmt: skip
SD3_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip


def model_config(path: Path, t5_tokenizer: Path) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(path).model, resolve=True)
    cfg["params"]["ckpt_path"] = None
    cfg["params"]["conditioner_config"]["params"]["t5xxl"] = {"tokenizer": str(t5_tokenizer)}
    return cfg


def shapes(sd) -> dict:
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("preset", sorted(FULL))
def test_full_size_model_is_stabilitys_single_file(preset, tmp_path):
    """The whole model on the meta device: diffusers' converters consume every key of each
    part and give exactly the keys and shapes of the diffusers models of the released repos."""
    with torch.device("meta"):
        model = instantiate_from_config(model_config(FULL[preset], t5_tokenizer_folder(tmp_path)))
    state = model.state_dict()
    prefixes = (layout.BACKBONE, layout.TEXT_ENCODERS, layout.FIRST_STAGE)
    assert all(k.startswith(prefixes) for k in state), [
        k for k in state if not k.startswith(prefixes)
    ][:5]
    assert single_file_utils.infer_diffusers_model_type(state) == preset
    assert family.model_family(model) == family.SD3

    backbone = {k: v for k, v in state.items() if k.startswith(layout.BACKBONE)}
    converted = single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers(dict(backbone))
    with torch.device("meta"):
        reference = SD3Transformer2DModel(**TRANSFORMER_CONFIGS[preset])
    assert shapes(converted) == shapes(reference.state_dict())

    for prefix, config in (
        (layout.CLIP_L, CLIP_VIT_L14_TEXT_CONFIG),
        (layout.CLIP_G, CLIP_G_TEXT_CONFIG),
    ):
        text = single_file_utils.convert_ldm_clip_checkpoint(state, prefix)
        if prefix == layout.CLIP_L:  # diffusers' SD3 rule: CLIP-L's projection is the identity
            text["text_projection.weight"] = torch.eye(768, device="meta")
        with torch.device("meta"):
            clip = CLIPTextModelWithProjection(CLIPTextConfig(**config))
        assert shapes(text) == shapes(clip.state_dict())
    t5 = single_file_utils.convert_sd3_t5_checkpoint_to_diffusers(state)
    with torch.device("meta"):
        reference_t5 = T5EncoderModel(T5Config(**T5_XXL_CONFIG))
    expected = shapes(reference_t5.state_dict())
    expected.pop("encoder.embed_tokens.weight")  # tied to shared.weight: once in the file
    assert shapes(t5) == expected

    # The VAE: diffusers' single-file VAE rule on our first_stage_model.* (no quant convs).
    vae_file = {k: v for k, v in state.items() if k.startswith(layout.FIRST_STAGE)}
    vae = single_file_utils.convert_ldm_vae_checkpoint(vae_file, SD3_VAE)
    with torch.device("meta"):
        reference_vae = AutoencoderKL(**SD3_VAE)
    assert shapes(vae) == shapes(reference_vae.state_dict())


@pytest.fixture(scope="module")
def tiny_state(tmp_path_factory) -> dict:
    """The tiny SD3 with T5, random non-zero weights everywhere."""
    folder = t5_tokenizer_folder(tmp_path_factory.mktemp("t5tok"))
    cfg = model_config(TINY, folder)
    cfg["params"]["conditioner_config"]["params"]["t5xxl"]["config"] = {
        "d_model": 48, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    model = instantiate_from_config(cfg)
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()}


def test_diffusers_components_round_trip_bit_exact(tiny_state):
    components = layout.to_diffusers(tiny_state)
    assert set(components) == set(layout.COMPONENTS)
    back = layout.from_diffusers(components)
    assert back.keys() == tiny_state.keys()
    assert all(torch.equal(back[k], tiny_state[k]) for k in back)
    # the transformer's inverse against diffusers' converter on a second, independent state
    again = layout.to_diffusers(back)
    assert all(
        torch.equal(again[c][k], components[c][k]) for c in components for k in components[c]
    )


def test_transformer_from_diffusers_loads_and_runs_as_diffusers(tiny_state):
    """A diffusers SD3Transformer2DModel's own weights, read by from_diffusers, give our MMDiT
    the same output (the inverse names every tensor right, not just round-trips)."""
    from ldm.mmdit import MMDiT

    cfg = OmegaConf.load(TINY).model.params.backbone_config.params
    theirs = SD3Transformer2DModel(
        sample_size=cfg.sample_size, patch_size=2, in_channels=16, out_channels=16,
        num_layers=cfg.depth, attention_head_dim=cfg.hidden_size // cfg.num_heads,
        num_attention_heads=cfg.num_heads, joint_attention_dim=cfg.context_dim,
        caption_projection_dim=cfg.hidden_size, pooled_projection_dim=cfg.pooled_dim,
        pos_embed_max_size=cfg.pos_embed_max_size, qk_norm="rms_norm",
        dual_attention_layers=tuple(cfg.dual_attention_layers),
    ).eval()  # fmt: skip
    torch.manual_seed(3)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    ours = MMDiT(**OmegaConf.to_container(cfg)).eval()
    ours.load_state_dict(layout.transformer_from_diffusers(theirs.state_dict()), strict=True)
    x, ctx, pooled = (
        torch.randn(2, 16, 8, 6),
        torch.randn(2, 5, cfg.context_dim),
        torch.randn(2, cfg.pooled_dim),
    )
    t = torch.tensor([100.0, 700.0])
    with torch.no_grad():
        expected = theirs(
            x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t
        ).sample
        got = ours(x, t, {"crossattn": ctx, "vector": pooled})
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_family_of_sd3_files_and_folders(tiny_state, tmp_path):
    assert family.model_family(tiny_state) == family.SD3
    bare = [k.removeprefix(layout.BACKBONE) for k in tiny_state if k.startswith(layout.BACKBONE)]
    assert family.model_family(bare) == family.SD3  # a transformer-only file
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    assert family.diffusers_family(tmp_path) == family.SD3
    # DiT stays DiT, SD 1.x stays SD 1.x
    assert family.model_family(["model.diffusion_model.x_embedder.proj.weight"]) == family.DIT
    assert family.model_family(["cond_stage_model.transformer.x"]) == family.SD1
    with pytest.raises(
        WrongFileError, match=r"^sd3\.safetensors is an SD 3 checkpoint, expected an SD 1\.x"
    ):
        check_family("sd3.safetensors", family.SD3, family.SD1)
    with pytest.raises(
        WrongFileError, match=r"^v1\.ckpt is an SD 1\.x checkpoint, expected an SD 3"
    ):
        check_family("v1.ckpt", family.SD1, family.SD3)
