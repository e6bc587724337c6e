"""A pipeline folder written by diffusers itself, used as our starting point end to end:
txt2img draws the image diffusers' own pipeline draws, convert.py writes it as one original
file, and a broken folder stops every entry point with one line and exit status 2."""

import json
import shutil
from pathlib import Path

import convert
import numpy as np
import pytest
import torch
import txt2img
from omegaconf import OmegaConf
from PIL import Image
from run_helpers import load_main
from swap_vae import main as swap_vae
from vae_helpers import assert_decodes_like, trained  # noqa: F401 (fixture)

from ldm import checkpoint
from ldm.text_encoder import bpe_vocab_path, bytes_to_unicode, clip_vocab_and_merges
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

diffusers = pytest.importorskip("diffusers")
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

pytestmark = pytest.mark.slow
MERGES = 200  # a small BPE vocabulary: 512 byte tokens + 200 merges + 2 special tokens
VOCAB = 512 + MERGES + 2


def small_tokenizer(folder: Path) -> CLIPTokenizer:
    """A CLIP BPE tokenizer with the first MERGES merges only: ids that differ from the full
    vocabulary's (and exceed this text encoder's table), so only the folder's tokenizer works."""
    _, merges = clip_vocab_and_merges(bpe_vocab_path())
    merges = merges[:MERGES]
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77)


def random_weights(module: torch.nn.Module, seed: int) -> None:
    """Every weight drawn at a trained network's scale (norms ~1, weights ~1/sqrt(fan_in)): no
    zero-initialised output layer lets a wrong mapping pass unseen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=generator)
                if isinstance(sub, torch.nn.GroupNorm | torch.nn.LayerNorm):
                    param.copy_((1.0 if name == "weight" else 0.0) + 0.2 * noise)
                elif param.ndim == 1:
                    param.copy_(0.2 * noise)
                else:
                    param.copy_(noise / param[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory, tiny_config):
    """(folder saved by diffusers' StableDiffusionPipeline, our YAML for it, the pipeline)."""
    root = tmp_path_factory.mktemp("diffusers_made")
    tokenizer = small_tokenizer(root / "vocab")
    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=(2, 4),  # diffusers' name for the head count: 16 channels a head
        use_linear_projection=True,
    )
    random_weights(unet, seed=0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        sample_size=32,
    )
    torch.manual_seed(1)
    text_config = CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_act="quick_gelu",
        bos_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
        pad_token_id=VOCAB - 1,
    )
    scheduler = diffusers.DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    folder = root / "pipeline"
    pipe.save_pretrained(folder, safe_serialization=True)
    # Our YAML for it: the tiny config, with this text encoder's vocabulary.
    text = "model.params.cond_stage_config.params.config"
    overrides = [f"{text}.vocab_size={VOCAB}", f"{text}.eos_token_id={VOCAB - 1}"]
    overrides += [f"{text}.bos_token_id={VOCAB - 2}", f"{text}.pad_token_id={VOCAB - 1}"]
    config = root / "tiny-from-diffusers.yaml"
    OmegaConf.save(merge_configs([tiny_config], overrides), config)
    return folder, config, pipe


def test_txt2img_from_a_diffusers_folder_draws_the_pipelines_image(tmp_path, pipeline_folder):
    folder, config, pipe = pipeline_folder
    seed, prompt = 3, "a blue square"
    txt2img.main(
        ["--ckpt", str(folder), "--config", str(config), "--prompt", prompt, "--steps", "5"]
        + ["--scale", "4", "--seed", str(seed), "--outdir", str(tmp_path), "--skip_grid"]
        + ["--device", "cpu", "--H", "16", "--W", "16"]  # the size of the 8x8 latents below
    )
    png = Image.open(tmp_path / "samples" / "00000.png")
    ours = np.asarray(png, dtype=np.float32) / 255
    assert "Model hash: " + checkpoint.file_hash(folder) in png.text["parameters"]
    # txt2img's starting noise for this seed (lun.generation.starting_noise).
    noise = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    theirs = pipe(
        prompt,
        height=16,
        width=16,
        num_inference_steps=5,
        guidance_scale=4.0,
        latents=noise,
        output_type="np",
    ).images[0]
    # The SD export test's tolerance (2e-3 of the range), plus the PNG's rounding to 1/255.
    np.testing.assert_allclose(ours, theirs, atol=2e-3 + 0.5 / 255, rtol=0)
    assert ours.std() > 0.05  # an image, not a flat field


def test_convert_writes_the_folder_as_one_original_file(tmp_path, pipeline_folder):
    folder, config, _ = pipeline_folder
    out = tmp_path / "model.safetensors"
    convert.main([str(folder), str(out), "--config", str(config)])
    model_config = to_container(merge_configs([config]))["model"]
    from_file, from_folder = (instantiate_from_config(model_config) for _ in range(2))
    checkpoint.load_weights(from_file, out)  # strict: the complete original layout
    checkpoint.load_weights(from_folder, folder)
    ours, theirs = from_file.state_dict(), from_folder.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_broken_folder_is_one_line_and_exit_2_before_a_run_folder(
    tmp_path, pipeline_folder, shapes_dir, capsys
):
    folder, config, _ = pipeline_folder
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "unet")
    with pytest.raises(SystemExit) as stop:
        txt2img.main(["--ckpt", str(broken), "--config", str(config), "--outdir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{broken}/unet/config.json: missing" in err

    logs = tmp_path / "logs"
    status = load_main().main(
        ["--base", str(config), f"model.params.ckpt_path={broken}", "-l", str(logs)]
        + [f"data.params.train.params.data_root={shapes_dir}"]
    )
    assert status == 2
    err = capsys.readouterr().err  # (after the log lines of building the data)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("config error: ")
    assert "unet/config.json: missing" in err.strip().splitlines()[-1]
    assert not logs.exists() or not any(logs.iterdir())


# A VAE trained here, through convert.py and swap_vae.py into one original file, read back by
# `StableDiffusionPipeline.from_single_file` (offline, this folder as its config): its VAE
# decodes as ours, its other parts are untouched, its images are our VAE's decoding of its
# latents. (Here to share the pipeline fixture.)
def test_swapped_checkpoint_loads_in_diffusers_pipeline_and_decodes_as_ours(
    tmp_path,
    pipeline_folder,
    trained,  # noqa: F811
):
    folder, config, pipe = pipeline_folder
    vae_ckpt, ours = trained
    single = tmp_path / "model.safetensors"
    convert.main([str(folder), str(single), "--config", str(config)])
    swapped = tmp_path / "model-myvae.safetensors"
    args = ["--vae", str(vae_ckpt), "--ckpt", str(single), "--out", str(swapped)]
    assert swap_vae(args) == 0

    theirs = diffusers.StableDiffusionPipeline.from_single_file(
        str(swapped), config=str(folder), local_files_only=True, safety_checker=None
    )
    assert_decodes_like(ours, theirs.vae.eval())  # the new VAE, by diffusers' key conversion
    for part in ("unet", "text_encoder"):  # the rest of the checkpoint as it was
        before, after = getattr(pipe, part).state_dict(), getattr(theirs, part).state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), part
    original_vae = pipe.vae.state_dict()["decoder.conv_out.weight"]
    assert not torch.equal(theirs.vae.state_dict()["decoder.conv_out.weight"], original_vae)

    # The pipeline end to end: its image is our VAE's decoding of its final latents.
    noise = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    seen = {}

    def keep_latents(pipeline, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return tensors

    image = theirs(
        "a blue square", height=32, width=32, num_inference_steps=2, latents=noise,
        output_type="pt", callback_on_step_end=keep_latents,
    ).images  # fmt: skip
    latents = seen["latents"]
    with torch.no_grad():
        decoded = ours.decode(latents / theirs.vae.config.scaling_factor)
    expected = (decoded / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(image, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.05  # an image, not a flat field
