"""Every shipped YAML under configs/ is built and trained for 2 steps through the launcher.

The list is a glob, so a new config is covered the day it is added. Each one runs at toy size:
- model configs of Stable Diffusion size (the v1/v2 fine-tuning and inference configs) get a
  tiny-model override set, derived from the parts they name (UNet, VAE, CLIP or OpenCLIP);
- a config with a `ckpt_path` starts from a tiny checkpoint in the original layout saved first;
- a config without a `data` section (the original inference configs) is merged with the `data`
  and `lightning` sections of configs/tiny/ldm.yaml;
- a config with only a `lightning` section (a strategy preset) is merged after configs/tiny/ldm.yaml
  and runs in one CPU process, unless another test launches it with its model (most with 2
  processes; `PRESETS_LAUNCHED_ELSEWHERE` names that test, and a test here checks it still does);
- SDXL configs (sgm's GeneralConditioner) get tests/sdxl_helpers.py's tiny SDXL;
- DiT configs get a DiT of width 32 and depth 1, class-folder data the shapes as 18 classes, and a
  VAE file they require (`first_stage_config.params.ckpt_path: ???`) a random tiny VAE;
- SD3 and Flux configs get configs/sd3/tiny.yaml's / configs/flux/tiny.yaml's parts (Flux: a toy
  T5 tokenizer folder, its T5 being required).
"""

import ast
import functools
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from run_helpers import ROOT, run_main, run_main_here
from sd3_helpers import t5_tokenizer_folder
from sdxl_helpers import tiny_sdxl_overrides

from ldm.checkpoint import load_weights, save_safetensors
from ldm.util import instantiate_from_config
from lun.config import check_complete, merge_configs, to_container
from lun.strategies import load_training_checkpoint

TINY = ROOT / "configs" / "tiny" / "ldm.yaml"


def trains_a_vae(path: Path) -> bool:
    """A config whose model is an autoencoder (configs/autoencoder, configs/tiny/vae.yaml)."""
    return "autoencoder" in str(OmegaConf.select(OmegaConf.load(path), "model.target", default=""))


def config_id(path: Path) -> str:
    return path.relative_to(ROOT / "configs").as_posix()


# The autoencoder configs train another module (no UNet): tests/e2e/test_vae_launcher.py runs them.
CONFIGS = sorted(p for p in (ROOT / "configs").glob("**/*.yaml") if not trains_a_vae(p))
# Strategy presets that the test named launches through main.py with a model it fits (most with
# 2 processes, and with checks of what the strategy saves): a 1-process run here would only
# repeat their start-up (DeepSpeed's alone costs more than a minute on 2 cores).
TWO_PROCESS_RESUME = (
    "tests/lun/test_strategies.py",
    "test_two_processes_train_resume_and_export_one_file",
)
PRESETS_LAUNCHED_ELSEWHERE = {
    "lightning/ddp.yaml": (
        "tests/e2e/test_resume.py",
        "test_two_process_ddp_resume_is_bitwise_exact",
    ),
    "lightning/deepspeed_stage2.yaml": TWO_PROCESS_RESUME,
    "lightning/deepspeed_stage3.yaml": TWO_PROCESS_RESUME,
    "lightning/fsdp.yaml": TWO_PROCESS_RESUME,
    "lightning/fsdp-dit.yaml": (
        "tests/e2e/test_dit_e2e.py",
        "test_fsdp_wraps_dit_blocks_and_saves_the_released_names",
    ),
    "lightning/fsdp-vae.yaml": (
        "tests/e2e/test_vae_resume.py",
        "test_two_process_fsdp_trains_as_ddp",
    ),
}
# The demo's overlays go on configs/demo/shapes.yaml, not on the tiny config: that test file
# trains each through main.py on the shapes (its `OVERLAYS`) and scores it.
DEMO_OVERLAYS_TRAINED_BY = "tests/e2e/test_demo_flow.py"
DEMO_OVERLAYS = {"demo/shapes-flow.yaml", "demo/shapes-mmdit.yaml"}
CONFIG_PARAMS = [
    p
    for p in CONFIGS
    if config_id(p) not in PRESETS_LAUNCHED_ELSEWHERE and config_id(p) not in DEMO_OVERLAYS
]
# A backbone wider than this is "Stable Diffusion size" and is shrunk (the shipped small ones: 32).
TINY_WIDTH = 32


def test_the_glob_finds_the_shipped_configs():
    names = {config_id(p) for p in CONFIGS}
    assert {
        "tiny/ldm.yaml",
        "demo/shapes.yaml",
        "stable-diffusion/v1-inference.yaml",
        "stable-diffusion/v2-inference-v.yaml",
        "stable-diffusion/v1-finetune.yaml",
        "lightning/fsdp.yaml",
    } <= names


def test_presets_left_out_here_are_launched_by_the_test_named():
    """The named test still exists and names the preset in its own text (its parameters or its
    body), and launches main.py."""
    for preset, (test_file, test_name) in PRESETS_LAUNCHED_ELSEWHERE.items():
        assert (ROOT / "configs" / preset).is_file(), preset
        source = (ROOT / test_file).read_text()
        (test,) = [
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name == test_name
        ]
        first = min([test.lineno] + [d.lineno for d in test.decorator_list])
        text = "\n".join(source.splitlines()[first - 1 : test.end_lineno])
        launches = "run_main(" in source or '"main.py"' in source
        assert f'"{Path(preset).stem}' in text and launches, (preset, test_file, test_name)


def test_demo_overlays_left_out_here_are_trained_by_the_demo_test():
    source = (ROOT / DEMO_OVERLAYS_TRAINED_BY).read_text()
    (overlays,) = [
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "OVERLAYS"
    ]
    trained = {f"demo/{name}" for name in ast.literal_eval(overlays)}
    assert DEMO_OVERLAYS <= trained and "start_demo(" in source, trained
    on_disk = {config_id(p) for p in CONFIGS if p.parent.name == "demo" and p.name != "shapes.yaml"}
    assert on_disk == DEMO_OVERLAYS  # a new demo overlay is trained somewhere: add it there


# --- tiny overrides, from the parts a config names -----------------------------------------------


def part(params: DictConfig, *names: str) -> tuple[str, DictConfig]:
    """(dotted key, config) of the first of `names` (original or our spelling) in `params`."""
    for name in names:
        if name in params:
            return f"model.params.{name}", params[name]
    raise AssertionError(f"model.params has none of {names}")


def tiny_model_overrides(model: DictConfig) -> list[str]:
    """Dotlist overrides that shrink a Stable Diffusion-size model to toy width (32 px images),
    or [] for a model that is already small. A part this function does not know is a failure
    that says where to teach it."""
    params = model.params
    unet_key, unet = part(params, "unet_config", "backbone_config", "network_config")
    if unet.target.startswith("ldm.dit"):
        return tiny_dit_overrides(model)
    if unet.target.startswith("ldm.mmdit"):
        return tiny_sd3_overrides(model)
    if unet.target.startswith("ldm.flux"):
        return tiny_flux_overrides(model)
    if unet.params.model_channels <= TINY_WIDTH:
        return []
    if "conditioner_config" in params and params.conditioner_config.target.endswith(
        "GeneralConditioner"
    ):  # SDXL
        return [*tiny_sdxl_overrides(model), "model.params.image_size=16"]
    vae_key, vae = part(params, "first_stage_config")
    text_key, text = part(params, "cond_stage_config", "conditioner_config")
    heads = (
        "num_head_channels=16"
        if unet.params.get("num_head_channels", -1) != -1
        else "num_heads=2"  # SD 1: a head count
    )
    overrides = [
        f"{unet_key}.params.model_channels={TINY_WIDTH}",
        f"{unet_key}.params.channel_mult=[1,2]",
        f"{unet_key}.params.num_res_blocks=1",
        f"{unet_key}.params.attention_resolutions=[1,2]",
        f"{unet_key}.params.context_dim=32",
        f"{unet_key}.params.{heads}",
        "model.params.image_size=16",  # latent side of 32 px images with the 2-level VAE below
    ]
    if vae.target.endswith("AutoencoderKL"):
        overrides += [
            f"{vae_key}.params.ddconfig.ch=32",
            f"{vae_key}.params.ddconfig.ch_mult=[1,2]",
            f"{vae_key}.params.ddconfig.num_res_blocks=1",
            f"{vae_key}.params.ddconfig.resolution=32",
        ]
    elif not vae.target.endswith("IdentityFirstStage"):
        pytest.fail(f"no tiny override for the first stage {vae.target}: add one here")
    if text.target.endswith(".FrozenCLIPEmbedder"):
        overrides.append(
            f"{text_key}.params.config={{hidden_size: 32, intermediate_size: 64, "
            "num_hidden_layers: 2, num_attention_heads: 2}"
        )
    elif text.target.endswith(".FrozenOpenCLIPEmbedder"):
        overrides += [
            f"{text_key}.params.{name}={value}"
            for name, value in (("width", 32), ("layers", 2), ("heads", 2), ("embed_dim", 32))
        ]
    else:
        pytest.fail(f"no tiny override for the text encoder {text.target}: add one here")
    return overrides


def tiny_dit_overrides(model: DictConfig) -> list[str]:
    """A DiT / TextDiT config at toy size: width 32, one block, 8x8 latents; its VAE and text
    encoder shrunk like the UNet configs' (a required VAE file becomes a random tiny VAE)."""
    backbone, vae = model.params.backbone_config, model.params.first_stage_config
    if backbone.params.get("hidden_size", 1152) <= TINY_WIDTH * 4:
        return []  # the shapes demo: already small
    key = "model.params.backbone_config.params"
    overrides = [
        # a preset (DiT_XL_2) fixes the sizes: its class (DiT, TextDiT) takes them all
        f"model.params.backbone_config.target={re.sub(r'_(S|B|L|XL)_[248]$', '', backbone.target)}",
        f"{key}.hidden_size={TINY_WIDTH}",
        f"{key}.depth=1",
        f"{key}.num_heads=2",
        f"{key}.patch_size=2",
        f"{key}.input_size=8",
    ]
    if vae.target.endswith("AutoencoderKL"):
        vae_key = "model.params.first_stage_config.params"
        overrides += [
            f"{vae_key}.ckpt_path=null",
            f"{vae_key}.ddconfig.ch=32",
            f"{vae_key}.ddconfig.ch_mult=[1,2]",
            f"{vae_key}.ddconfig.num_res_blocks=1",
            f"{vae_key}.ddconfig.resolution=32",
        ]
    if model.params.conditioner_config.target.endswith(".FrozenCLIPEmbedder"):
        overrides += [
            "model.params.conditioner_config.params.config={hidden_size: 32, intermediate_size: 64, "
            "num_hidden_layers: 2, num_attention_heads: 2}",
            f"{key}.context_dim=32",
        ]
    return overrides + ["data.params.train.params.size=16"]  # 16 px -> 8 x 8 latents


def tiny_sd3_overrides(model: DictConfig) -> list[str]:
    """An SD 3.5 config at toy size: configs/sd3/tiny.yaml's MMDiT, VAE and text encoders (no
    T5: its tokenizer folder is the user's); [] for that tiny config itself."""
    if model.params.backbone_config.params.get("hidden_size", 1536) <= TINY_WIDTH:
        return []
    tiny = OmegaConf.to_container(
        OmegaConf.load(ROOT / "configs" / "sd3" / "tiny.yaml").model.params
    )  # values as JSON, which a dotlist reads as YAML
    text = "model.params.conditioner_config.params"
    vae = "model.params.first_stage_config.params.ddconfig"
    return [
        f"model.params.backbone_config={json.dumps(tiny['backbone_config'])}",
        *(f"{text}.{k}={json.dumps(v)}" for k, v in tiny["conditioner_config"]["params"].items()),
        f"{vae}.ch=32",
        f"{vae}.ch_mult=[1,2]",
        f"{vae}.num_res_blocks=1",
        f"{vae}.resolution=32",
    ]


@functools.cache
def tiny_t5_tokenizer() -> Path:
    """One T5-like tokenizer folder for the Flux configs (their T5 is not optional)."""
    return t5_tokenizer_folder(Path(tempfile.mkdtemp(prefix="lun_t5_tokenizer_")))


def tiny_flux_overrides(model: DictConfig) -> list[str]:
    """A Flux.1 config at toy size: configs/flux/tiny.yaml's transformer (dev's guidance input
    or not, as the config's preset), VAE and text encoders (random, a toy T5 tokenizer); [] for
    that tiny config itself."""
    backbone = model.params.backbone_config
    text = "model.params.conditioner_config.params"
    if backbone.params.get("hidden_size", 3072) <= TINY_WIDTH:
        return [f"{text}.t5xxl.tokenizer={tiny_t5_tokenizer()}"]
    tiny = OmegaConf.to_container(
        OmegaConf.load(ROOT / "configs" / "flux" / "tiny.yaml").model.params
    )  # values as JSON, which a dotlist reads as YAML
    tiny["backbone_config"]["params"]["guidance_embed"] = backbone.target.endswith("flux1_dev")
    vae = "model.params.first_stage_config.params.ddconfig"
    tiny_text = tiny["conditioner_config"]["params"]
    return [
        f"model.params.backbone_config={json.dumps(tiny['backbone_config'])}",
        f"{text}.clip_l={json.dumps({'version': None, **tiny_text['clip_l']})}",
        f"{text}.t5xxl={json.dumps({**tiny_text['t5xxl'], 'version': None})}",
        f"{text}.t5xxl.tokenizer={tiny_t5_tokenizer()}",
        f"{text}.t5_tokens={tiny_text['t5_tokens']}",
        f"{vae}.ch=32",
        f"{vae}.ch_mult=[1,2]",
        f"{vae}.num_res_blocks=1",
        f"{vae}.resolution=32",
    ]


def tiny_data_and_trainer(tmp_path: Path) -> Path:
    """configs/tiny/ldm.yaml without its model: the data and lightning sections, as a file."""
    tiny = OmegaConf.load(TINY)
    path = tmp_path / "tiny-data.yaml"
    OmegaConf.save({"data": tiny.data, "lightning": tiny.lightning}, path)
    return path


def save_tiny_checkpoint(bases: list, overrides: list[str], path: Path) -> dict:
    """Build the model the run will build, with other random weights, and save it in the
    original layout: the run must start from these (ckpt_path), not from its own init."""
    cfg = merge_configs(bases, [*overrides, "model.params.ckpt_path=null"])
    check_complete(cfg)
    torch.manual_seed(1)  # the launcher seeds 23: different weights unless the file is loaded
    state = instantiate_from_config(to_container(cfg)["model"]).state_dict()
    save_safetensors(state, path)
    return state


def is_overlay(config: Path) -> bool:
    """Model settings without a model (configs/tiny/lora.yaml): merged after configs/tiny/ldm.yaml."""
    own = OmegaConf.load(config)
    return "model" in own and "target" not in own.model


def is_inference_config(config: Path) -> bool:
    """A model without data (the original v1/v2 inference configs)."""
    own = OmegaConf.load(config)
    return "model" in own and "data" not in own and not is_overlay(config)


def launcher_args(
    config: Path, tmp_path: Path, shapes_dir: Path, shape_classes_dir: Path
) -> tuple[list, list[str]]:
    """The --base files and the overrides that make `config` a 2-step toy run on CPU."""
    own = OmegaConf.load(config)
    if "model" not in own:  # a strategy preset: merged after a model config
        assert set(own) == {"lightning"}, f"{config}: neither a model config nor a preset"
        bases = [TINY, config]
    elif is_overlay(config):
        bases = [TINY, config]
    elif is_inference_config(config):  # give it data and a trainer
        bases = [config, tiny_data_and_trainer(tmp_path)]
    else:
        bases = [config]
    merged = merge_configs(bases)
    train = merged.data.params.train
    data_roots = {
        "lun.data.local.Local": shapes_dir,
        "lun.data.class_folder.ClassFolder": shape_classes_dir,
        "lun.data.dreambooth.DreamBooth": shapes_dir,
    }
    assert train.target in data_roots, f"{config}: teach this test {train.target}"
    overrides = tiny_model_overrides(merged.model)
    if train.target == "lun.data.dreambooth.DreamBooth":  # its base model draws 2 class images
        key = "data.params.train.params"
        overrides += [
            f"{key}.class_data_root={tmp_path / 'class-images'}",
            f"{key}.num_class_images=2",
            f"{key}.sample_steps=2",
        ]
    if overrides and not any(o.startswith("data.params.train.params.size=") for o in overrides):
        overrides.append("data.params.train.params.size=32")
        if train.params.get("buckets"):  # buckets of ~32 x 32 pixels
            overrides.append("data.params.train.params.buckets.step=8")
    overrides += [
        f"data.params.train.params.data_root={data_roots[train.target]}",
        "data.params.batch_size=2",
        "data.params.num_workers=0",
        "lightning.trainer.accelerator=cpu",
        "lightning.trainer.devices=1",
        "lightning.trainer.max_steps=2",
    ]
    return bases, overrides


# --- every config, 2 steps ---------------------------------------------------------------------


def train_two_steps(
    config: Path, tmp_path: Path, shapes_dir: Path, shape_classes_dir: Path, extra: list[str]
):
    """Run the launcher on `config` at toy size; (its result, the run's logs, start weights)."""
    bases, overrides = launcher_args(config, tmp_path, shapes_dir, shape_classes_dir)
    start = None
    if "ckpt_path" in merge_configs(bases).model.params.keys():  # `in` alone skips `???`
        weights = tmp_path / "start.safetensors"
        start = save_tiny_checkpoint(bases, overrides, weights)
        overrides.append(f"model.params.ckpt_path={weights}")

    logs = tmp_path / "logs"
    # In this process: ~30 configs, each subprocess spent seconds importing torch and Lightning.
    # DeepSpeed keeps its process groups in module state, stale once a run has closed them.
    args = ["--base", *bases, *overrides, *extra, "-l", logs, "-t"]
    if "deepspeed" in config.name:
        return run_main(list(map(str, args)), cwd=tmp_path), logs, start
    return run_main_here(args, cwd=tmp_path), logs, start


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIG_PARAMS, ids=config_id)
def test_every_config_trains_two_steps_through_the_launcher(
    config, tmp_path, shapes_dir, shape_classes_dir
):
    result, logs, start = train_two_steps(config, tmp_path, shapes_dir, shape_classes_dir, [])
    assert result.returncode == 0, result.stderr[-3000:]

    (run,) = logs.iterdir()
    trained = load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    assert trained["global_step"] == 2
    state = trained["state_dict"]
    backbone = [k for k in state if k.startswith("model.diffusion_model.")]
    conditioner = OmegaConf.select(
        merge_configs([config]), "model.params.conditioner_config.target", default=""
    )
    class_labels = conditioner.endswith("ClassLabels")
    # a text encoder is in the checkpoint (SDXL: sgm's conditioner); class labels have no weights
    text = ("cond_stage_model.", "conditioner.embedders.", "text_encoders.")
    assert backbone and (class_labels or any(k.startswith(text) for k in state))
    if start is not None:  # the run started from the tiny checkpoint and trained its UNet
        vae = [k for k in start if k.startswith("first_stage_model.")]
        assert vae and all(torch.equal(state[k], start[k]) for k in vae)  # frozen: as loaded
        assert any(not torch.equal(state[k].float(), start[k].float()) for k in backbone)
    if is_inference_config(config):  # what it is for: sampling, here from the trained weights
        (saved,) = (run / "configs").glob("*-project.yaml")
        model = instantiate_from_config(to_container(merge_configs([saved]))["model"])
        load_weights(model, run / "checkpoints" / "last.ckpt")
        generator = torch.Generator().manual_seed(0)
        images = model.eval().sample(
            ["a red circle"], steps=1, height=32, width=32, generator=generator
        )
        assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()
