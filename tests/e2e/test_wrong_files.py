"""Wrong files, as a table: tiny files of each family and kind x each entry point.

Each case ends with exit status 2, ONE line on stderr naming the file, what it is and what was
expected, and nothing written. The files are built once per module by the helpers that build
them elsewhere (tiny SD 1.x / 2.x / SDXL / DiT / VAE-run models, a kohya LoRA file); which
family each file is, is known here by construction - not asked of the detector under test.
The family detector itself is checked against the released models' key lists
(tests/reference/, written from the original projects' code).
"""

import json
import os

import cache_latents
import convert
import evaluate
import img2img
import lora as lora_script
import pytest
import swap_vae
import torch
import txt2img
import yaml
from eval_helpers import make_small_features
from lora_helpers import build, randomize_adapters
from PIL import Image
from run_helpers import ROOT, assert_one_line, run_main_here, script_outcome
from safetensors.torch import save_file
from sdxl_helpers import tiny_sdxl, tiny_sdxl_config

from ldm import checkpoint, lora
from ldm.layout import family
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

REFERENCE = ROOT / "tests" / "reference"
LORA_SETTINGS = "{rank: 2, alpha: 2, targets: [attn]}"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("sd_v1_keys", family.SD1),
        ("sd_v2_base_keys", family.SD2),
        ("sd_v2_v_keys", family.SD2),
        ("sdxl_base_keys", family.SDXL),
        ("dit_xl2_256_keys", family.DIT),
        ("dit_s2_keys", family.DIT),
        ("kohya_lora_sd1_example_keys", family.LORA),
    ],
)
def test_the_released_models_key_lists_are_their_families(name, expected):
    keys = list(json.loads((REFERENCE / f"{name}.json").read_text())["keys"])
    assert family.model_family(keys) == expected
    if expected in (family.SD1, family.SD2, family.SDXL):
        # Its VAE alone (what swap_vae.py writes: the bare original names) is a VAE...
        vae = [k.removeprefix("first_stage_model.") for k in keys if "first_stage_model." in k]
        assert family.model_family(vae) == family.VAE
        # ...and the model with EMA shadows and LoRA adapters beside it is still the model.
        assert family.model_family([*keys, "lora.x.lora_A.weight"]) == expected


def random_model(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    return instantiate_from_config(config["model"])


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_config, shape_classes_dir):
    """name -> path: configs (*_config) and weights files of each family and kind, made once."""
    out = tmp_path_factory.mktemp("wrong_files")
    found = {"sd1_config": tiny_config}
    sd1 = random_model(to_container(merge_configs([tiny_config])))
    checkpoint.save_safetensors(sd1.state_dict(), out / "sd1.safetensors")
    found["sd1"] = out / "sd1.safetensors"

    v2 = yaml.safe_load(tiny_config.read_text())
    v2["model"]["params"]["cond_stage_config"] = {
        "target": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
        "params": {"width": 32, "layers": 2, "heads": 2, "embed_dim": 32},
    }
    (out / "sd2.yaml").write_text(yaml.safe_dump(v2))
    checkpoint.save_safetensors(random_model(v2).state_dict(), out / "sd2.safetensors")
    found["sd2"] = out / "sd2.safetensors"

    (out / "sdxl.yaml").write_text(yaml.safe_dump(tiny_sdxl_config()))
    found["sdxl_config"] = out / "sdxl.yaml"
    checkpoint.save_safetensors(tiny_sdxl().state_dict(), out / "sdxl.safetensors")
    found["sdxl"] = out / "sdxl.safetensors"

    # A class-conditional DiT on pixels, with the class-folder data it was "trained" on (the
    # class names --class accepts); saved as a Lightning .ckpt (a pickle, as runs write them).
    dit_params = {"input_size": 8, "patch_size": 2, "in_channels": 3, "hidden_size": 32}
    dit = {
        "model": {
            "target": "ldm.diffusion.LatentDiffusion",
            "params": {
                "backbone_config": {
                    "target": "ldm.dit.DiT",
                    "params": {**dit_params, "depth": 1, "num_heads": 2, "num_classes": 18},
                },
                "first_stage_config": {"target": "ldm.autoencoder.IdentityFirstStage"},
                "conditioner_config": {
                    "target": "ldm.conditioning.ClassLabels",
                    "params": {"num_classes": 18},
                },
                "scale_factor": 1.0,
            },
        },
        "data": {
            "target": "lun.data.DataModule",
            "params": {
                "train": {
                    "target": "lun.data.class_folder.ClassFolder",
                    "params": {"data_root": str(shape_classes_dir)},
                }
            },
        },
    }
    (out / "dit.yaml").write_text(yaml.safe_dump(dit))
    found["dit_config"] = out / "dit.yaml"
    torch.save({"state_dict": random_model(dit).state_dict()}, out / "dit.ckpt")
    found["dit"] = out / "dit.ckpt"

    vae_config = to_container(merge_configs([ROOT / "configs" / "autoencoder" / "tiny.yaml"]))
    torch.save({"state_dict": random_model(vae_config).state_dict()}, out / "vae_run.ckpt")
    found["vae_run"] = out / "vae_run.ckpt"

    with_adapters = build(tiny_config, LORA_SETTINGS)
    randomize_adapters(with_adapters)
    kohya = {k: v.contiguous() for k, v in lora.kohya_state_dict(with_adapters).items()}
    save_file(kohya, out / "style.safetensors")
    found["lora"] = out / "style.safetensors"
    # diffusers folders, refused by their pipeline class (diffusers' names) before any loading:
    # SDXL's, and SD 2.x's (StableDiffusionPipeline with OpenCLIP's `gelu` text encoder).
    for name, pipeline, act in [
        ("sdxl_folder", "StableDiffusionXLPipeline", "quick_gelu"),
        ("sd2_folder", "StableDiffusionPipeline", "gelu"),
    ]:
        (out / name / "text_encoder").mkdir(parents=True)
        (out / name / "unet").mkdir()
        (out / name / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        config = {"architectures": ["CLIPTextModel"], "hidden_act": act}
        (out / name / "text_encoder" / "config.json").write_text(json.dumps(config))
        found[name] = out / name
    Image.new("RGB", (32, 32), "white").save(out / "init.png")
    found["init"] = out / "init.png"
    return found


def generation(files, out, config, ckpt):
    return ["--config", files[config], "--ckpt", files[ckpt], "--outdir", out, "--steps", "1"]


# (script, config, file given as --ckpt, what the message must say it is, what it expected)
MODEL_CASES = [
    (txt2img, "sd1_config", "sdxl", "is an SDXL checkpoint", "an SD 1.x"),
    (txt2img, "sd1_config", "sd2", "is an SD 2.x checkpoint", "an SD 1.x"),
    (txt2img, "sd1_config", "dit", "is a DiT checkpoint", "an SD 1.x"),
    (txt2img, "sd1_config", "vae_run", "is a VAE checkpoint", "an SD 1.x"),
    (txt2img, "sd1_config", "lora", "is a LoRA file", "an SD 1.x"),
    (txt2img, "sdxl_config", "sd1", "is an SD 1.x checkpoint", "an SDXL"),
    (txt2img, "dit_config", "sdxl", "is an SDXL checkpoint", "a DiT"),
    (txt2img, "sd1_config", "sdxl_folder", "is a diffusers folder (SDXL)", "an SD 1.x"),
    (txt2img, "sd1_config", "sd2_folder", "is a diffusers folder (SD 2.x)", "an SD 1.x"),
    (img2img, "sd1_config", "sdxl", "is an SDXL checkpoint", "an SD 1.x"),
    (img2img, "sd1_config", "vae_run", "is a VAE checkpoint", "an SD 1.x"),
]


@pytest.mark.parametrize(
    "script, config, ckpt, found, expected",
    MODEL_CASES,
    ids=[f"{c[0].__name__}-{c[1]}-{c[2]}" for c in MODEL_CASES],
)
def test_a_model_of_another_family_is_one_line(
    files, tmp_path, capsys, script, config, ckpt, found, expected
):
    argv = generation(files, tmp_path / "out", config, ckpt)
    if script is img2img:
        argv += ["--init-img", files["init"]]
    status, lines = script_outcome(script.main, argv, capsys)
    assert_one_line(status, lines, f"--ckpt {files[ckpt]} {found}", f"expected {expected}")
    assert not (tmp_path / "out").exists()


# (extra arguments on the right model, the words of the message)
OPTION_CASES = {
    "vae-is-a-lora": ("sd1", ["--vae", "lora"], ["--vae", "is a LoRA file", "expected a VAE"]),
    "vae-is-a-dit": ("sd1", ["--vae", "dit"], ["--vae", "is a DiT checkpoint", "expected a VAE"]),
    "lora-is-a-model": ("sd1", ["--lora", "sd2"], ["--lora", "is an SD 2.x", "expected a LoRA"]),
    "lora-is-a-vae": ("sd1", ["--lora", "vae_run"], ["is a VAE checkpoint", "expected a LoRA"]),
    "lora-on-a-dit": ("dit", ["--lora", "lora", "--class", "1"], ["--lora", "this model is a DiT"]),
    "prompt-on-a-dit": ("dit", ["--prompt", "a red circle"], ["draws classes", "--class"]),
    "class-on-sd": ("sd1", ["--class", "3"], ["--class", "text-conditional", "--prompt"]),
    "unknown-class-name": (
        "dit",
        ["--class", "purple-star"],
        ["--class purple-star", "blue-circle"],
    ),
    "class-out-of-range": ("dit", ["--class", "18"], ["--class 18", "0..17"]),
    "missing-ckpt": ("missing", [], ["--ckpt", "no such file"]),
    "missing-vae": ("sd1", ["--vae", "missing"], ["--vae", "no such file"]),
    "missing-lora": ("sd1", ["--lora", "missing"], ["--lora", "not found"]),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_a_wrong_option_file_or_conditioning_is_one_line(files, tmp_path, capsys, case):
    ckpt, extra, words = OPTION_CASES[case]
    files = {**files, "missing": tmp_path / "missing.safetensors"}
    config = "dit_config" if ckpt == "dit" else "sd1_config"
    extra = [files.get(a, a) if i % 2 else a for i, a in enumerate(extra)]
    argv = generation(files, tmp_path / "out", config, ckpt) + extra
    status, lines = script_outcome(txt2img.main, argv, capsys)
    assert_one_line(status, lines, *words)
    assert not (tmp_path / "out").exists()


def test_class_names_of_the_training_folders_draw_their_classes(files, tmp_path, capsys):
    """`--class red-circle` is the id of that folder in sorted order, as ClassFolder numbers
    them (torchvision's ImageFolder rule): its PNG says the same class as `--class <id>`."""
    config = yaml.safe_load(files["dit_config"].read_text())
    names = sorted(os.listdir(config["data"]["params"]["train"]["params"]["data_root"]))
    name = names[5]
    argv = generation(files, tmp_path / "out", "dit_config", "dit") + ["--class", name]
    txt2img.main([str(a) for a in argv])
    (png,) = (tmp_path / "out" / "samples").glob("*.png")
    with Image.open(png) as image:
        assert image.text["parameters"].startswith("class 5\n")


def file_cases(files, tmp_path):
    """(main, argv, words) for the other scripts."""
    out = tmp_path / "out.safetensors"
    features = make_small_features(tmp_path / "features.safetensors", size=16)
    return {
        "convert-lora": (convert.main, [files["lora"], out], ["is a LoRA file", "a model"]),
        "convert-sdxl-for-sd1": (
            convert.main,
            [files["sdxl"], out, "--config", files["sd1_config"]],
            ["is an SDXL checkpoint", "expected an SD 1.x"],
        ),
        "lora-merge-sdxl-for-sd1": (
            lora_script.main,
            ["merge", files["sdxl"], out, "--config", files["sd1_config"], "--lora", files["lora"]],
            ["is an SDXL checkpoint", "expected an SD 1.x"],
        ),
        "lora-merge-a-vae-as-lora": (
            lora_script.main,
            [
                "merge",
                files["sd1"],
                out,
                "--config",
                files["sd1_config"],
                "--lora",
                files["vae_run"],
            ],
            ["--lora", "is a VAE checkpoint", "expected a LoRA"],
        ),
        "lora-merge-on-a-dit": (
            lora_script.main,
            ["merge", files["dit"], out, "--config", files["dit_config"], "--lora", files["lora"]],
            ["--lora", "this model is a DiT"],
        ),
        "lora-export-sd2-for-sd1": (
            lora_script.main,
            ["export", files["sd2"], out, "--config", files["sd1_config"]],
            ["is an SD 2.x checkpoint", "expected an SD 1.x"],
        ),
        "swap-vae-lora-as-vae": (
            swap_vae.main,
            ["--vae", files["lora"], "--out", out],
            ["--vae", "is a LoRA file", "expected a VAE"],
        ),
        "swap-vae-into-a-vae": (
            swap_vae.main,
            ["--vae", files["vae_run"], "--ckpt", files["vae_run"], "--out", out],
            ["--ckpt", "is a VAE checkpoint", "expected a diffusion model"],
        ),
        "evaluate-sdxl-for-sd1": (
            evaluate.main,
            [files["sdxl"], "--base", files["sd1_config"], "--classes", "1"]
            + ["--reference", tmp_path, "--features", features, "--out", out],
            ["is an SDXL checkpoint", "expected an SD 1.x"],
        ),
        "evaluate-a-vae": (
            evaluate.main,
            [files["vae_run"], "--classes", "1", "--reference", tmp_path]
            + ["--features", features, "--out", out],
            ["is a VAE checkpoint", "expected a diffusion model"],
        ),
        "cache-latents-sdxl-for-sd1": (
            cache_latents.main,
            ["--base", files["sd1_config"], f"model.params.ckpt_path={files['sdxl']}"]
            + [f"data.params.train.params.data_root={tmp_path}", "--out", tmp_path / "cache"],
            ["is an SDXL checkpoint", "expected an SD 1.x"],
        ),
        "cache-latents-missing-ckpt-path": (
            cache_latents.main,
            ["--base", files["sd1_config"], f"model.params.ckpt_path={tmp_path / 'typo.ckpt'}"]
            + [f"data.params.train.params.data_root={tmp_path}", "--out", tmp_path / "cache"],
            ["model.params.ckpt_path", "typo.ckpt", "no such file"],
        ),
    }


SCRIPT_CASES = [
    "convert-lora",
    "convert-sdxl-for-sd1",
    "lora-merge-sdxl-for-sd1",
    "lora-merge-a-vae-as-lora",
    "lora-merge-on-a-dit",
    "lora-export-sd2-for-sd1",
    "swap-vae-lora-as-vae",
    "swap-vae-into-a-vae",
    "evaluate-sdxl-for-sd1",
    "evaluate-a-vae",
    "cache-latents-sdxl-for-sd1",
    "cache-latents-missing-ckpt-path",
]


@pytest.mark.parametrize("case", SCRIPT_CASES)
def test_every_script_names_the_wrong_file_in_one_line(files, tmp_path, capsys, case):
    main, argv, words = file_cases(files, tmp_path)[case]
    before = sorted(tmp_path.iterdir())
    status, lines = script_outcome(main, argv, capsys)
    assert_one_line(status, lines, *words)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


LAUNCHER_CASES = {
    "ckpt-path-missing": (["model.params.ckpt_path=typo.ckpt"], ["ckpt_path", "typo.ckpt"]),
    "ckpt-path-sdxl": (["model.params.ckpt_path={sdxl}"], ["SDXL", "expected an SD 1.x"]),
    "ckpt-path-vae-run": (["model.params.ckpt_path={vae_run}"], ["a VAE", "expected an SD 1.x"]),
    "resume-a-dit": (["--resume", "{dit}"], ["--resume", "is a DiT", "expected an SD 1.x"]),
}


@pytest.mark.parametrize("case", list(LAUNCHER_CASES))
def test_the_launcher_names_a_wrong_ckpt_path_or_resume_in_one_line(
    files, tmp_path, shapes_dir, case
):
    extra, words = LAUNCHER_CASES[case]
    extra = [a.format(**files) for a in extra]
    args = ["--base", files["sd1_config"], f"data.params.train.params.data_root={shapes_dir}"]
    result = run_main_here([*args, *extra, "-l", tmp_path / "logs", "-t"], tmp_path)
    # --resume says which checkpoint it found first (its log line), then stops.
    lines = [line for line in result.stderr.splitlines() if "lun.run: resuming from" not in line]
    assert_one_line(result.returncode, lines, *words)
    assert not (tmp_path / "logs").exists()


def test_a_vae_run_starts_from_any_model_holding_a_vae_but_not_from_a_lora(files):
    """configs/autoencoder/sd-vae-finetune.yaml: `ckpt_path` is an SD checkpoint (its
    first_stage_model.*), a VAE file or a VAE run's checkpoint - a LoRA file holds no VAE."""
    vae = to_container(merge_configs([ROOT / "configs" / "autoencoder" / "tiny.yaml"]))["model"]
    for name in ("sd1", "vae_run"):
        checkpoint.check_config_files(
            {**vae, "params": {**vae["params"], "ckpt_path": files[name]}}
        )
    with pytest.raises(checkpoint.WrongFileError, match="is a LoRA file, expected a VAE"):
        lora_run = {**vae["params"], "ckpt_path": files["lora"]}
        checkpoint.check_config_files({**vae, "params": lora_run})
