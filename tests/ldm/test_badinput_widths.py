"""A conditioner and a backbone that disagree on a width are one line when the model is built.

Before, such a config built (and passed `main.py` without -t) and died at the first training
step with a matmul shape error. Each family's tiny config is built with one width changed on
one side; the line names the backbone's key, both widths and what to set
(`ldm.conditioning.check_field_widths`, called where `LatentDiffusion` is built).
"""

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_helpers import ROOT
from sd3_helpers import t5_tokenizer_folder

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

CONFIGS = ROOT / "configs"
TINY_T5 = "{vocab_size: 64, d_model: 48, d_kv: 8, d_ff: 64, num_layers: 1, num_heads: 2}"


@functools.cache
def t5_tokenizer() -> Path:
    return t5_tokenizer_folder(Path(tempfile.mkdtemp(prefix="lun_widths_t5_")))


def build(config: str, *overrides: str, edit=None):
    """The model of configs/`config` with `overrides` (a toy T5 tokenizer for Flux), its params
    changed by `edit` where a dotlist cannot (a list entry, a part replaced whole)."""
    if config == "flux/tiny.yaml":
        overrides = (f"model.params.conditioner_config.params.t5xxl.tokenizer={t5_tokenizer()}",
                     *overrides)  # fmt: skip
    model = to_container(merge_configs([CONFIGS / config], list(overrides)))["model"]
    if edit is not None:
        edit(model["params"])
    torch.manual_seed(0)
    return instantiate_from_config(model)


def one_line(config: str, *overrides: str, edit=None) -> str:
    with pytest.raises(ValueError) as caught:
        build(config, *overrides, edit=edit)
    message = str(caught.value)
    assert "\n" not in message
    return message


def sdxl_embedder(index: int, **params):
    """An edit of configs/tiny/sdxl.yaml: the params of its embedder `index` updated."""

    def edit(model: dict) -> None:
        model["conditioner_config"]["params"]["emb_models"][index]["params"].update(params)

    return edit


def replaced(part: str, target: str, **params):
    """An edit: the model's `part` config replaced by `target` with `params`."""

    def edit(model: dict) -> None:
        model[part] = {"target": target, "params": params}

    return edit


def backbone_as(target: str, drop: str, **params):
    """An edit: the backbone's target changed, its parameter `drop` removed, `params` set."""

    def edit(model: dict) -> None:
        backbone = model["backbone_config"]
        backbone["params"].pop(drop)
        backbone["params"].update(params)
        backbone["target"] = target

    return edit


SD_UNET = "model.params.unet_config.params"
SD_TEXT = "model.params.cond_stage_config.params"
XL_UNET = "model.params.network_config.params"
XL_TEXT = "model.params.conditioner_config.params.emb_models"
BACKBONE = "model.params.backbone_config.params"
TEXT = "model.params.conditioner_config.params"

# (case id, config, overrides, an edit of the model's params, how the error line starts)
MISMATCHES = [
    (
        "sd1 context_dim",
        "tiny/ldm.yaml",
        [f"{SD_UNET}.context_dim=48"],
        None,
        "context_dim=48: UNetModel reads crossattn (text tokens) 48 wide, but conditioner_config "
        "(FrozenCLIPEmbedder) makes 32 wide; set context_dim: 32, or configure the conditioner to "
        "make 48 wide",
    ),
    (
        "sd2 OpenCLIP on an SD1 UNet",
        "tiny/ldm.yaml",
        [],
        replaced(
            "cond_stage_config",
            "ldm.text_encoder.FrozenOpenCLIPEmbedder",
            width=64,
            layers=1,
            heads=2,
            embed_dim=64,
        ),  # fmt: skip
        "context_dim=32: UNetModel reads crossattn (text tokens) 32 wide, but "
        "conditioner_config (FrozenOpenCLIPEmbedder) makes 64 wide; set context_dim: 64",
    ),
    (
        "sdxl adm_in_channels",
        "tiny/sdxl.yaml",
        [f"{XL_UNET}.adm_in_channels=96"],
        None,
        "adm_in_channels=96: UNetModel reads vector (pooled vector) 96 wide, but "
        "conditioner_config (GeneralConditioner) makes 80 wide; set adm_in_channels: 80",
    ),
    (
        "sdxl size embedding outdim",
        "tiny/sdxl.yaml",
        [],
        sdxl_embedder(2, outdim=16),
        "adm_in_channels=80: UNetModel reads vector (pooled vector) 80 wide, but "
        "conditioner_config (GeneralConditioner) makes 96 wide; set adm_in_channels: 96",
    ),
    (
        "sdxl bigG width",
        "tiny/sdxl.yaml",
        [],
        sdxl_embedder(1, width=64),
        "context_dim=64: UNetModel reads crossattn (text tokens) 64 wide, but "
        "conditioner_config (GeneralConditioner) makes 96 wide; set context_dim: 96",
    ),
    (
        "sdxl no adm",
        "tiny/sdxl.yaml",
        [f"{XL_UNET}.adm_in_channels=null", f"{XL_UNET}.num_classes=null"],
        None,
        "conditioner_config (GeneralConditioner) makes vector (pooled vector) 80 wide, which "
        "UNetModel does not read; set the backbone's adm_in_channels: 80, or use a conditioner "
        "without it",
    ),
    (
        "sd3 context_dim",
        "sd3/tiny.yaml",
        [f"{BACKBONE}.context_dim=64"],
        None,
        "context_dim=64: MMDiT reads crossattn (text tokens) 64 wide, but conditioner_config "
        "(SD3Conditioner) makes 48 wide; set context_dim: 48",
    ),
    (
        "sd3 pooled_dim vs clip_g",
        "sd3/tiny.yaml",
        [f"{TEXT}.clip_g.config.projection_dim=32"],
        None,
        "pooled_dim=40: MMDiT reads vector (pooled vector) 40 wide, but conditioner_config "
        "(SD3Conditioner) makes 48 wide; set pooled_dim: 48",
    ),
    (
        "flux pooled_dim",
        "flux/tiny.yaml",
        [f"{BACKBONE}.pooled_dim=24"],
        None,
        "pooled_dim=24: Flux reads vector (pooled vector) 24 wide, but conditioner_config "
        "(FluxConditioner) makes 16 wide; set pooled_dim: 16",
    ),
    (
        "flux context_dim vs T5",
        "flux/tiny.yaml",
        [f"{TEXT}.t5xxl.config.d_model=64"],
        None,
        "context_dim=48: Flux reads crossattn (text tokens) 48 wide, but conditioner_config "
        "(FluxConditioner) makes 64 wide; set context_dim: 64",
    ),
    (
        "dit text context_dim",
        "tiny/dit.yaml",
        [f"{BACKBONE}.context_dim=48"],
        None,
        "context_dim=48: TextDiT reads crossattn (text tokens) 48 wide, but conditioner_config "
        "(FrozenCLIPEmbedder) makes 32 wide; set context_dim: 32",
    ),
    (
        "dit text backbone, class labels",
        "tiny/dit.yaml",
        [],
        replaced("conditioner_config", "ldm.conditioning.ClassLabels", num_classes=4),
        "context_dim=32: TextDiT reads crossattn (text tokens), which conditioner_config "
        "(ClassLabels) does not make (it makes y); use a conditioner that makes crossattn, or a "
        "backbone that reads what this one makes",
    ),
    (
        "dit class backbone, text encoder",
        "tiny/dit.yaml",
        [],
        backbone_as("ldm.dit.DiT", "context_dim", num_classes=4),
        "num_classes=4: DiT reads y (class labels), which conditioner_config (FrozenCLIPEmbedder) "
        "does not make (it makes crossattn); use a conditioner that makes y",
    ),
]


@pytest.mark.parametrize(
    ("config", "overrides", "edit", "expected"),
    [case[1:] for case in MISMATCHES],
    ids=[case[0] for case in MISMATCHES],
)
def test_a_width_mismatch_is_one_line_naming_the_key_and_both_widths(
    config, overrides, edit, expected
):
    assert one_line(config, *overrides, edit=edit).startswith(expected)


def test_more_class_labels_than_the_dit_table_has_rows_is_one_line():
    """Labels of 18 classes on a DiT of 4: ids past its table (an index error at step 1)."""
    assert one_line(
        "dit/shapes-dit.yaml", f"{BACKBONE}.num_classes=4", f"{BACKBONE}.hidden_size=32"
    ).startswith(
        "num_classes=4: DiT reads y (class labels) 4 classes, but conditioner_config "
        "(ClassLabels) makes 18 classes; set num_classes: 18"
    )
    build("dit/shapes-dit.yaml", f"{BACKBONE}.num_classes=1000", f"{BACKBONE}.hidden_size=32")


@pytest.mark.parametrize(
    ("config", "overrides", "edit"),
    [
        ("tiny/ldm.yaml", [], None),
        ("tiny/sdxl.yaml", [], None),
        ("tiny/sdxl.yaml", [f"{XL_UNET}.context_dim=96"], sdxl_embedder(1, width=64)),
        ("tiny/dit.yaml", [], None),
        ("sd3/tiny.yaml", [], None),
        ("flux/tiny.yaml", [], None),
        ("sd3/tiny.yaml", [f"{TEXT}.t5xxl={{config: {TINY_T5}}}"], None),
    ],
    ids=["sd1", "sdxl", "sdxl bigG 64 wide, pooled 32", "dit", "sd3", "flux", "sd3 with t5"],
)
def test_the_tiny_configs_agree_and_report_the_widths_they_use(config, overrides, edit):
    """Both sides report their widths from config, and for the shipped tiny configs they are
    equal - and what one conditioning pass makes (no forward ran to find them)."""
    if "t5xxl=" in " ".join(overrides):
        overrides = [*overrides, f"{TEXT}.t5xxl.tokenizer={t5_tokenizer()}"]
    model = build(config, *overrides, edit=edit).eval()
    made, read = model.conditioner.field_widths, model.backbone.field_widths
    assert made == read and made
    batch = {"caption": ["a red circle", ""], "image": torch.zeros(2, 3, 32, 32)}
    cond = model.conditioner.condition(batch)
    assert {field: cond[field].shape[-1] for field in made} == made


def test_an_unknown_part_is_not_checked():
    """A backbone of the user's own that does not say its widths builds as before."""
    from ldm.conditioning import check_field_widths
    from ldm.text_encoder import FrozenCLIPEmbedder

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    text = FrozenCLIPEmbedder(config={**tiny, "num_attention_heads": 2})
    check_field_widths(text, torch.nn.Linear(2, 2))  # no field_widths: nothing to compare


# --- the shipped configs at full size -------------------------------------------------------------
def is_model_config(path: Path) -> bool:
    """A whole diffusion model (not an overlay, not an autoencoder to train)."""
    model = OmegaConf.load(path).get("model")
    return model is not None and "target" in model and "utoencoder" not in model.target


FULL_SIZE = sorted(p for p in CONFIGS.glob("**/*.yaml") if is_model_config(p))


def offline(node):
    """A model config without its files: no weights to load (`ckpt_path`), encoders built
    from their config (`version`), T5's tokenizer the toy one."""
    if isinstance(node, dict):
        for key in ("ckpt_path", "version"):
            node.pop(key, None)
        if isinstance(node.get("t5xxl"), dict):
            node["t5xxl"]["tokenizer"] = str(t5_tokenizer())
        for value in node.values():
            offline(value)
    elif isinstance(node, list):
        for value in node:
            offline(value)


@pytest.mark.parametrize("path", FULL_SIZE, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_every_shipped_model_config_agrees_at_full_size(path):
    """tests/e2e/test_configs.py trains each config at toy width, with overrides that set both
    sides' widths: this builds them at their own width, on the meta device (no memory, no
    weights - the widths come from the parts' configs), so a shipped config whose conditioner
    and backbone disagree fails here."""
    model = to_container(merge_configs([path], []))["model"]
    offline(model)
    model["params"].pop("lora", None)  # adapters change no width (and cost seconds at this size)
    with torch.device("meta"):
        built = instantiate_from_config(model)
    assert built.conditioner.field_widths == built.backbone.field_widths


def test_sdxl_refiner_aesthetic_score_is_one_number_wide():
    """sgm's refiner embeds `aesthetic_score` (B, 1) with the size embedder: outdim wide, not
    2 x outdim as the (height, width) pairs - what its adm_in_channels 2560 counts."""
    from ldm.conditioning_xl import GeneralConditioner

    sizes = {"target": "ldm.conditioning_xl.ConcatTimestepEmbedderND", "params": {"outdim": 8}}
    conditioner = GeneralConditioner(
        [
            {**sizes, "input_key": "original_size_as_tuple"},
            {**sizes, "input_key": "aesthetic_score"},
        ]
    )
    assert conditioner.field_widths == {"vector": 2 * 8 + 8}
    batch = {"aesthetic_score": torch.full((2, 1), 6.0), "image": torch.zeros(2, 3, 32, 32)}
    assert conditioner.condition(batch)["vector"].shape == (2, 24)
