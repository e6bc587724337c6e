"""main.py with a conditioner / backbone width mismatch: exit 2, one config-error line naming the
key, no run folder - with -t and without (the check that builds everything and writes nothing).

One case runs `python main.py` itself; the others run the launcher's main() in this process
(`run_main_here`: a config error stops before any training, and a subprocess would pay the torch
and Lightning imports again per case).
"""

import pytest
from run_helpers import ROOT, run_main, run_main_here
from sd3_helpers import t5_tokenizer_folder

CONFIGS = ROOT / "configs"
DATA_ROOT = "data.params.train.params.data_root"


def assert_one_config_error_line(result, expected: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1 and errors[0].startswith(f"config error: {expected}"), errors


def test_the_real_command_line_refuses_an_sd_unet_of_another_context_width(tmp_path, shapes_dir):
    """The SD 1 tiny UNet told context_dim 768 (CLIP ViT-L's) beside the tiny 32-wide CLIP."""
    args = [
        "--base",
        str(CONFIGS / "tiny" / "ldm.yaml"),
        f"{DATA_ROOT}={shapes_dir}",
        "model.params.unet_config.params.context_dim=768",
        "-l",
        str(tmp_path / "logs"),
        "-t",
    ]
    result = run_main(args, cwd=tmp_path)
    assert_one_config_error_line(
        result,
        "model.params.unet_config.params.context_dim=768: UNetModel reads crossattn (text "
        "tokens) 768 wide, but conditioner_config (FrozenCLIPEmbedder) makes 32 wide; set "
        "context_dim: 32, or configure the conditioner to make 768 wide",
    )
    assert not (tmp_path / "logs").exists() and not list(tmp_path.rglob("*.ckpt"))


@pytest.fixture(scope="module")
def t5_tokenizer(tmp_path_factory):
    return t5_tokenizer_folder(tmp_path_factory.mktemp("t5_tokenizer"))


BACKBONE = "model.params.backbone_config.params"
# (case id, config, overrides, how the error line starts)
CASES = [
    (
        "sdxl",
        "tiny/sdxl.yaml",
        ["model.params.network_config.params.adm_in_channels=2816"],
        "model.params.network_config.params.adm_in_channels=2816: UNetModel reads vector",
    ),
    ("sd3", "sd3/tiny.yaml", [f"{BACKBONE}.pooled_dim=2048"], f"{BACKBONE}.pooled_dim=2048: MMDiT"),
    (
        "flux without clip_l",
        "flux/tiny.yaml",
        ["model.params.conditioner_config.params.clip_l=null"],
        f"{BACKBONE}.pooled_dim=16: Flux reads vector (pooled vector) 16 wide, but "
        "conditioner_config (FluxConditioner) makes 768 wide; set pooled_dim: 768",
    ),
    ("dit", "tiny/dit.yaml", [f"{BACKBONE}.context_dim=4096"], f"{BACKBONE}.context_dim=4096:"),
]


@pytest.mark.parametrize("train", [True, False], ids=["-t", "check"])
@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_family_refuses_a_width_mismatch_before_the_run(
    tmp_path, shapes_dir, t5_tokenizer, config, overrides, expected, train
):
    if config == "flux/tiny.yaml":
        overrides = [
            *overrides,
            f"model.params.conditioner_config.params.t5xxl.tokenizer={t5_tokenizer}",
        ]
    args = ["--base", str(CONFIGS / config), f"{DATA_ROOT}={shapes_dir}", *overrides]
    args += ["-l", str(tmp_path / "logs"), *(["-t"] if train else [])]
    result = run_main_here(args, cwd=tmp_path)
    assert_one_config_error_line(result, expected)
    assert not (tmp_path / "logs").exists() and not list(tmp_path.rglob("*.ckpt"))
