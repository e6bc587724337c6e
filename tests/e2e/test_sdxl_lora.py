"""SDXL LoRA files (`scripts/lora.py export`) in diffusers' own loader, and in our txt2img.

kohya-ss trains SDXL on its sgm UNet, so its SDXL files name UNet modules by their original names
(`lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q`) and the text encoders `lora_te1_`
/ `lora_te2_`; diffusers' `StableDiffusionXLPipeline.load_lora_weights` converts those names with
its own rules (lora_conversion_utils.py), and reads the diffusers/peft format natively. The
pipeline is our `--to-diffusers` export of the base; adapters on the UNet and both text encoders
have weights at a trained scale, so a wrong name, scale or skipped encoder changes the image."""

import logging
import warnings

import convert
import lora as lora_script
import numpy as np
import pytest
import torch
import txt2img
from omegaconf import OmegaConf
from PIL import Image
from safetensors import safe_open
from sdxl_helpers import TEXT_WIDTH, tiny_sdxl, tiny_sdxl_config, trained_scale_weights

from ldm import checkpoint, lora
from ldm.layout.original import SGM_CLIP_PREFIX, SGM_OPENCLIP_PREFIX
from ldm.util import instantiate_from_config

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow
SETTINGS = "{rank: 4, alpha: 2, text_encoder: {rank: 2, alpha: 1}}"
SEED, PROMPT, HEIGHT, WIDTH, STEPS, SCALE = 3, "a red circle", 16, 24, 3, 4.0


def trained_scale_adapters(model: torch.nn.Module, seed: int) -> None:
    """A ~ 1/sqrt(fan_in), B ~ 0.5/sqrt(rank): each update about a quarter of its weight (peft's
    B = 0 would make every file look right)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                scale = 1.0 if ".lora_A." in name else 0.5
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(scale * noise / param[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Base weights + config, the diffusers folder of the base, a LoRA run's checkpoint + config,
    and its two exports (kohya, diffusers format)."""
    root = tmp_path_factory.mktemp("sdxl_lora")
    base = tiny_sdxl(seed=4)
    trained_scale_weights(base, seed=4)
    paths = {name: root / name for name in ("base.yaml", "lora.yaml", "pipeline")}
    paths["base"] = root / "base.safetensors"
    OmegaConf.save(tiny_sdxl_config(), paths["base.yaml"])
    checkpoint.save_safetensors(base.state_dict(), paths["base"])
    convert.main(
        [str(paths["base"]), "--config", str(paths["base.yaml"]), "--to-diffusers"]
        + [str(paths["pipeline"])]
    )

    lora_config = tiny_sdxl_config([f"model.params.lora={SETTINGS}"])
    OmegaConf.save(lora_config, paths["lora.yaml"])
    model = instantiate_from_config(lora_config["model"])
    checkpoint.load_weights(model, paths["base"])  # a base file into the adapters' model
    trained_scale_adapters(model, seed=5)
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)  # as a LoRA run's checkpoint holds it
    paths["run"] = root / "last.ckpt"
    torch.save(saved, paths["run"])
    for kind in ("kohya", "diffusers"):
        paths[kind] = root / f"{kind}.safetensors"
        lora_script.main(
            ["export", str(paths["run"]), str(paths[kind]), "--config", str(paths["lora.yaml"])]
            + ["--format", kind]
        )
    paths["adapters"] = lora.adapter_layers(model)
    return paths


def test_kohya_export_uses_kohyas_sdxl_names(files):
    with safe_open(str(files["kohya"]), framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert metadata["ss_v2"] == "False"
    modules = {k.split(".")[0] for k in keys}
    for name in (
        "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q",
        "lora_unet_input_blocks_5_1_transformer_blocks_1_attn2_to_out_0",
        "lora_unet_middle_block_1_proj_in",
        "lora_unet_output_blocks_2_1_transformer_blocks_0_ff_net_0_proj",
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
        "lora_te2_text_model_encoder_layers_1_mlp_fc2",  # bigG's last block: the pooled output
    ):
        assert name in modules, name
    # CLIP-L's last layer is not read (hidden_states[-2]): no adapter there.
    assert not any(m.startswith("lora_te1_text_model_encoder_layers_1_") for m in modules)
    assert len(modules) == len(files["adapters"]) + 2 * 2  # bigG's fused q/k/v: 3 names each
    assert not any(m.startswith(("lora_te_", "lora_unet_down_blocks")) for m in modules)


def our_image(files, tmp_path, lora_file) -> np.ndarray:
    out = tmp_path / (lora_file.stem if lora_file else "base")
    txt2img.main(
        ["--ckpt", str(files["base"]), "--config", str(files["base.yaml"]), "--prompt", PROMPT]
        + ["--steps", str(STEPS), "--scale", str(SCALE), "--seed", str(SEED)]
        + ["--H", str(HEIGHT), "--W", str(WIDTH), "--outdir", str(out), "--skip_grid"]
        + ["--device", "cpu", "--sampler", "ddim"]
        + (["--lora", str(lora_file)] if lora_file else [])
    )
    return np.asarray(Image.open(out / "samples" / "00000.png"), dtype=np.float32) / 255


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def lora_layers(module: torch.nn.Module) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in module.modules())


def load_into(pipe, lora_file) -> None:
    """`pipe.load_lora_weights`, failing on any missing / unexpected-keys warning."""
    records = Records()
    logging.getLogger("diffusers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.load_lora_weights(lora_file.parent, weight_name=lora_file.name)
    finally:
        logging.getLogger("diffusers").removeHandler(records)
    said = records.lines + [str(w.message) for w in caught]
    assert not [s for s in said if "missing" in s.lower() or "unexpected" in s.lower()], said


def test_diffusers_sdxl_pipeline_loads_our_files_and_draws_our_txt2img_images(tmp_path, files):
    """Same seed, DDIM steps, guidance and size conditioning as tests/ldm/test_sdxl_export.py; the
    kohya file and the diffusers-format file in turn on one pipeline."""
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(
        files["pipeline"], local_files_only=True
    )
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    adapters = files["adapters"]
    unet = sum(n.startswith("model.") for n in adapters)
    te1 = sum(n.startswith(SGM_CLIP_PREFIX) for n in adapters)
    te2 = sum(n.startswith(SGM_OPENCLIP_PREFIX) for n in adapters) + 2 * 2
    assert unet and te1 and te2
    for kind in ("kohya", "diffusers"):
        load_into(pipe, files[kind])
        # Every adapter landed: the UNet's, CLIP-L's and bigG's (its q/k/v as three layers).
        counts = [lora_layers(c) for c in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)]
        assert counts == [unet, te1, te2], kind
        # txt2img's starting noise for this seed; the tiny VAE halves each side
        shape = (1, 4, HEIGHT // 2, WIDTH // 2)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(SEED))
        theirs = pipe(
            PROMPT,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=STEPS,
            guidance_scale=SCALE,
            latents=noise,
            output_type="np",
        ).images[0]
        pipe.unload_lora_weights()
        ours = our_image(files, tmp_path, files[kind])
        # tests/ldm/test_sdxl_export.py's tolerance: 2e-3 of the range, plus the PNG's rounding.
        np.testing.assert_allclose(ours, theirs, atol=2e-3 + 0.5 / 255, rtol=0, err_msg=kind)
    assert np.abs(ours - our_image(files, tmp_path, None)).max() > 0.05  # the LoRA shows


def test_a_kohya_sdxl_file_merges_both_text_encoders(files):
    """txt2img's merge (`ldm.lora.merge_file`) of the kohya file gives the LoRA model's own
    conditioning - CLIP-L's part of the context, bigG's part and its pooled `vector` - where
    the base's differs in each."""
    config = OmegaConf.load(files["base.yaml"])
    merged = instantiate_from_config(OmegaConf.to_container(config)["model"]).eval()
    checkpoint.load_weights(merged, files["base"])
    batch = {"caption": [PROMPT], "image_size": [HEIGHT, WIDTH]}
    base = merged.conditioner.condition(batch)
    state = checkpoint.state_dict_of(checkpoint.load_file_state(files["kohya"]))
    assert lora.merge_file(merged, state) == len(files["adapters"]) + 2 * 2
    with_lora = instantiate_from_config(
        OmegaConf.to_container(OmegaConf.load(files["lora.yaml"]))["model"]
    )
    checkpoint.load_weights(with_lora.eval(), files["run"])
    with torch.no_grad():
        ours, expected = merged.conditioner.condition(batch), with_lora.conditioner.condition(batch)
    width = TEXT_WIDTH  # CLIP-L's channels come first in the context, then bigG's
    parts = {
        "te1": lambda c: c["crossattn"][..., :width],
        "te2": lambda c: c["crossattn"][..., width:],
        "te2 pooled": lambda c: c["vector"][:, :width],
    }
    for name, part in parts.items():
        torch.testing.assert_close(part(ours), part(expected), rtol=0, atol=1e-5, msg=name)
        assert (part(ours) - part(base)).abs().max() > 1e-2, name
