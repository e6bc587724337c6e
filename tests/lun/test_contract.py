"""Every LightningModule lun trains satisfies the contract (lun.contract), and the parts of lun
and the scripts that use a module use nothing else of it."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import ldm
from ldm.autoencoder_training import autoencoder_kl
from ldm.diffusion import LatentDiffusion
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container
from lun.contract import LatentModel, TrainableModule

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = {
    "ema_module",
    "log_images",
    "latent_shape",
    "default_image_size",
    "steps_own_optimizers",
}
# What every LightningModule has (Lightning's own API), which lun may also use.
LIGHTNING_API = {"device", "training", "train", "eval", "log", "trainer", "_trainer", "global_step"}
MODULE_API = {"named_parameters"}  # torch.nn.Module: where a weight sits in the checkpoint

# A model's parts: lun and the scripts ask the contract instead (lun/contract.py).
MODEL_INTERNALS = {"first_stage_model", "conditioner", "scale_factor", "shift_factor", "backbone"}
DVAE = dict(
    double_z=True, z_channels=4, resolution=32, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
    num_res_blocks=1, attn_resolutions=[], dropout=0.0,
)  # fmt: skip
LOSS = {
    "target": "ldm.vae_loss.LPIPSWithDiscriminator",
    "params": {"disc_start": 0, "perceptual_weight": 0.0, "disc_ndf": 8, "disc_num_layers": 2},
}


def build(config, *dotlist):
    return instantiate_from_config(to_container(merge_configs([config], dotlist))["model"])


@pytest.fixture(scope="module")
def tiny(tiny_config):
    return build(tiny_config)


@pytest.fixture(scope="module")
def vae():
    return autoencoder_kl(ddconfig=DVAE, lossconfig=LOSS, embed_dim=4)


def test_latent_diffusion_satisfies_the_contract(tiny):
    model = tiny
    assert isinstance(model, LatentDiffusion) and isinstance(model, LatentModel)
    assert isinstance(model, TrainableModule)
    assert model.ema_module is model.model
    assert model.latent_shape(32, 16) == (4, 16, 8)  # 2-level VAE: 2x smaller, 4 channels
    assert model.default_image_size == 32  # image_size 16 (latent) x 2
    images = model.eval().log_images({"caption": ["a", "b"]}, N=2, steps=1)
    assert images["samples"].shape == (2, 3, 32, 32)  # at the default size
    assert model.steps_own_optimizers is False  # Lightning steps its one optimizer


def test_the_vae_trainer_satisfies_the_contract(vae):
    assert isinstance(vae, TrainableModule) and not isinstance(vae, LatentModel)
    assert vae.steps_own_optimizers is True  # generator and discriminator: manual optimization
    assert vae.gradient_checkpointing is None
    with pytest.raises(ValueError, match="no gradient checkpointing"):
        vae.set_gradient_checkpointing(True)
    vae.set_gradient_checkpointing(False)  # off is what it is


def test_model_latents_are_shifted_then_scaled(tiny):
    """diffusers (SD3 training, `train_dreambooth_sd3.py`): latents = (latents - shift_factor)
    * scaling_factor. With shift 0 the SD 1.x/2.x rule: latents * 0.18215."""
    model = tiny
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.to_model_latents(z), z * 0.18215)
    model.scale_factor, model.shift_factor = 1.5305, 0.0609  # SD3's VAE (diffusers config)
    try:
        expected = (z - 0.0609) * 1.5305
        torch.testing.assert_close(model.to_model_latents(z), expected)
    finally:
        model.scale_factor, model.shift_factor = 0.18215, 0.0


def test_latents_and_captions_through_the_contract(tiny):
    """The moments are the VAE posterior's own (mean, log-variance); a latent is one draw from
    it, shifted and scaled; captions give the conditioner's fields, none dropped."""
    model = tiny.eval()
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    posterior = model.first_stage_model.encode(images)
    moments = model.first_stage_moments(images)
    assert torch.equal(moments, torch.cat([posterior.mean, posterior.logvar], 1))
    draw = posterior.sample(torch.Generator().manual_seed(3))
    latents = model.encode_latents(images, torch.Generator().manual_seed(3))
    torch.testing.assert_close(latents, draw * 0.18215)
    cond = model.encode_captions(["a red square", "a blue circle"])
    assert set(cond) == {"crossattn"} and cond["crossattn"].shape[0] == 2
    assert model.caption_conditioning_frozen is True  # the tiny CLIP is frozen
    assert model.class_count is None  # a text model


def test_class_count_of_a_class_model(tiny_config):
    classes = "{_replace_: true, target: ldm.conditioning.ClassLabels, params: {num_classes: 7}}"
    unet = "model.params.unet_config.params"
    model = build(
        tiny_config,
        f"model.params.cond_stage_config={classes}",
        f"{unet}.num_classes=7",  # a class UNet: labels in, no text context
        f"{unet}.context_dim=null",
    )
    assert model.class_count == 7
    assert model.caption_conditioning_frozen is False  # reads labels: nothing to cache


def test_cache_fingerprint_follows_the_vae_and_the_latent_geometry(tiny):
    model = tiny
    before = model.cache_fingerprint(text=True)
    assert before["scale_factor"] == 0.18215 and "shift_factor" not in before
    assert before["text"] is not None and model.cache_fingerprint()["text"] is None
    weight = next(model.first_stage_model.parameters())
    with torch.no_grad():
        weight.add_(1e-3)
        moved = model.cache_fingerprint(text=True)
        weight.sub_(1e-3)
    assert moved["first_stage"] != before["first_stage"] and moved["text"] == before["text"]
    model.shift_factor = 0.0609
    try:
        assert model.cache_fingerprint()["shift_factor"] == 0.0609
    finally:
        model.shift_factor = 0.0


def test_gradient_checkpointing_switches_the_backbone(tiny):
    model = tiny
    model.set_gradient_checkpointing(True)
    assert model.gradient_checkpointing is True and model.backbone.use_checkpoint is True
    model.set_gradient_checkpointing(False)
    assert model.gradient_checkpointing is False and model.backbone.use_checkpoint is False


def test_strategies_the_vae_trainer_cannot_run_under(vae, tiny):
    """Two optimizers stepped by hand: Lightning's DeepSpeed takes one; DDP needs
    find_unused_parameters; FSDP's gathered optimizer states cannot be resumed."""
    assert "DeepSpeed" in vae.strategy_problem("deepspeed")
    assert "find_unused_parameters" in vae.strategy_problem("ddp")
    assert vae.strategy_problem("ddp", find_unused_parameters=True) is None
    assert vae.strategy_problem("fsdp") is None
    assert vae.strategy_problem("fsdp", resuming=True).startswith("--resume:")
    assert vae.strategy_problem("single") is None
    for strategy in ("deepspeed", "ddp", "fsdp", "single"):
        assert tiny.strategy_problem(strategy, resuming=True) is None


def test_lun_uses_only_the_contract_of_pl_module():
    """Attribute reads of `pl_module` / `model` parameters in lun's callbacks stay inside the
    contract and Lightning's API."""
    used = set()
    for path in (ROOT / "lun" / "callbacks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "pl_module"
            ):
                used.add(node.attr)
    outside = used - CONTRACT - LIGHTNING_API - MODULE_API
    assert outside == set(), sorted(outside)
    assert {"ema_module", "log_images"} <= used


def parsed_arguments(tree: ast.AST) -> set[str]:
    """Names bound to `parser.parse_args(...)`: an option (`--shift-factor`) is no model part."""
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr in ("parse_args", "parse_known_args")
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def internals_read(source: str) -> set[str]:
    """The model part names `source` reads: `x.first_stage_model`, `getattr(x, "backbone")`."""
    found = set()
    tree = ast.parse(source)
    options = parsed_arguments(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in MODEL_INTERNALS:
            if not (isinstance(node.value, ast.Name) and node.value.id in options):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in MODEL_INTERNALS
        ):
            found.add(node.args[1].value)
    return found


def test_internals_read_sees_attributes_and_getattr():
    source = "model.first_stage_model.encode(x)\ngetattr(m, 'backbone', None)\nm.sample(x)"
    assert internals_read(source) == {"first_stage_model", "backbone"}


def test_internals_read_leaves_parsed_options_alone():
    """`--shift-factor` (scripts/swap_vae.py) is an option; the same name on a model is a read."""
    source = "opt = parser.parse_args(argv)\nf(opt.shift_factor)\n"
    assert internals_read(source) == set()
    assert internals_read(source + "model.shift_factor\n") == {"shift_factor"}


def test_lun_and_scripts_read_no_model_part():
    """lun and the scripts reach a model through lun.contract only: no file reads a part by name
    (the converters and benchmarks, which are about the parts, ask the contract's
    `latent_scaling`, `denoiser`, `caption_conditioner`)."""
    reads = {}
    for folder in ("lun", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            found = internals_read(path.read_text())
            if found:
                reads[name] = sorted(found)
    assert reads == {}


def model_modules() -> set[str]:
    """The ldm modules that define a torch module (a model or a part of one)."""
    found = set()
    for info in pkgutil.walk_packages(ldm.__path__, "ldm."):
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if value.__module__ == info.name and issubclass(value, torch.nn.Module):
                found.add(info.name)
    return found


# lun/data/dataset_report.py counts caption tokens with the text encoders' own tokenizers
# (owned by another helper this session; the tokenizers could move to a module of their own).
DATA_MAY_IMPORT = {"ldm.text_encoder"}


def test_lun_data_imports_no_model_module():
    """Data never knows the model: lun/data imports no ldm module that defines one."""
    models = model_modules()
    assert {"ldm.diffusion", "ldm.unet", "ldm.autoencoder", "ldm.text_encoder_xl"} <= models
    imported = {}
    for path in sorted((ROOT / "lun" / "data").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name in models - DATA_MAY_IMPORT:
                    imported.setdefault(path.name, set()).add(name)
    assert imported == {}


def test_the_parts_converters_write(tiny):
    """SD 1.x's VAE: scaling_factor 0.18215, no shift (diffusers' config of
    runwayml/stable-diffusion-v1-5's vae); the tiny model's denoiser is its UNet, its caption
    conditioner the CLIP text encoder."""
    from ldm.text_encoder import FrozenCLIPEmbedder
    from ldm.unet import UNetModel

    assert tiny.latent_scaling == (0.18215, 0.0)
    assert isinstance(tiny.denoiser, UNetModel)
    assert isinstance(tiny.caption_conditioner, FrozenCLIPEmbedder)
    tiny.shift_factor = 0.0609
    try:
        assert tiny.latent_scaling == (0.18215, 0.0609)
    finally:
        tiny.shift_factor = 0.0


def test_latent_shape_names_the_size_multiple(tiny):
    with pytest.raises(ValueError, match="multiples of 4"):
        tiny.latent_shape(30, 32)
    assert torch.Size(tiny.latent_shape(64, 64)) == (4, 32, 32)
