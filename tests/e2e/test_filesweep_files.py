"""What users pass by mistake to each script's file flags, as tables: damaged files, a folder for
a file (or a file for a folder), a missing path, an output path that cannot be written.

Each case ends with exit status 2, ONE line on stderr naming the file (and the flag, where a
flag named it), and nothing written; a pickle holding code never runs (a marker file). The
scripts' main() runs in this process (tests/e2e/test_script_errors.py does the same); the files
are built once per module. Wrong families: tests/e2e/test_wrong_files.py.
"""

import errno
import json
import os
import pickle

import convert
import demo
import eval_shapes
import evaluate
import fid_demo
import img2img
import lora as lora_script
import lora_concept
import pytest
import swap_vae
import torch
import txt2img
from eval_helpers import make_small_features
from lora_helpers import build, randomize_adapters
from PIL import Image
from run_helpers import ROOT, assert_one_line, run_main_here, script_outcome
from safetensors.torch import save_file

from ldm import checkpoint, lora
from ldm.util import instantiate_from_config
from lun import generation
from lun.config import merge_configs, to_container

CONFIG = ROOT / "configs" / "tiny" / "ldm.yaml"


class RunsCode:
    """Unpickled, it would create its marker file: the test that it never does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> path: good files to pair the bad ones with, and the bad ones."""
    out = tmp_path_factory.mktemp("filesweep")
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([CONFIG]))["model"])
    found = {"model": out / "model.safetensors", "marker": out / "code-ran"}
    checkpoint.save_safetensors(model.state_dict(), found["model"])
    whole = found["model"].read_bytes()
    torch.save({"state_dict": {"x": torch.zeros(4096)}}, out / "whole.ckpt")  # 17 kB
    zipped = (out / "whole.ckpt").read_bytes()
    with_adapters = build(CONFIG, "{rank: 2, alpha: 2, targets: [attn]}")
    randomize_adapters(with_adapters)
    found["lora"] = out / "style.safetensors"
    save_file(
        {k: v.contiguous() for k, v in lora.kohya_state_dict(with_adapters).items()}, found["lora"]
    )
    found["features"] = make_small_features(out / "features.safetensors", size=16)
    damaged = {
        "empty.safetensors": b"",
        "empty.ckpt": b"",
        "cut-in-header.safetensors": whole[:40],
        "cut-in-data.safetensors": whole[: len(whole) // 2],
        # torch: "failed finding central directory" for the first kB, a bare "[Errno 22]
        # Invalid argument" (an OSError naming nothing: exit status 1) for more.
        "cut-early.ckpt": zipped[:1000],
        "cut.ckpt": zipped[:5000],
        "random.safetensors": bytes(range(256)) * 16,
        "random.ckpt": bytes(range(7, 256)) * 16,
        "random.pt": bytes(reversed(range(256))) * 16,
    }
    for name, data in damaged.items():
        (out / name).write_bytes(data)
        found[name] = out / name
    # Code in a pickle, both ways users meet it: torch.save's zip file, and a plain pickle.dump
    # (protocol 4, which torch's weights-only reader cannot walk: it stopped at its FRAME).
    torch.save({"state_dict": {}, "x": RunsCode(found["marker"])}, out / "code.ckpt")
    with open(out / "code-pickle.ckpt", "wb") as f:
        pickle.dump({"state_dict": {}, "x": RunsCode(found["marker"])}, f, protocol=4)
    found["code.ckpt"], found["code-pickle.ckpt"] = out / "code.ckpt", out / "code-pickle.ckpt"
    (out / "a-folder").mkdir()
    for suffix in (".safetensors", ".json", ".png"):  # a folder where an output file goes
        (out / f"folder{suffix}").mkdir()
        found[f"folder{suffix}"] = out / f"folder{suffix}"
    (out / "a-file").write_text("not a folder\n")
    (out / "prompts.txt").write_text("a red circle\n")
    (out / "reference").mkdir()
    Image.new("RGB", (16, 16), "white").save(out / "reference" / "a.png")
    Image.new("RGB", (32, 32), "white").save(out / "init.png")
    # An SD 1.x diffusers folder with no vae/ (its configs say the family; no weights needed).
    folder = out / "pipeline-without-vae"
    for part, config in [("unet", {}), ("text_encoder", {"hidden_act": "quick_gelu"})]:
        (folder / part).mkdir(parents=True)
        (folder / part / "config.json").write_text(json.dumps(config))
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    found["pipeline-without-vae"] = folder
    for name in ("a-folder", "a-file", "prompts.txt", "reference", "init.png"):
        found[name] = out / name
    return found


def sample(files, tmp):
    return ["--config", CONFIG, "--outdir", tmp / "out", "--steps", "1", "--device", "cpu"]


def evaluation(files, tmp, ckpt=None):
    return [ckpt or files["model"], "--base", CONFIG, "--prompts", files["prompts.txt"]]


def evaluation_rest(files, tmp):
    return ["--reference", files["reference"], "--num-images", "2", "--steps", "1"]


# entry point -> (main, argv with the file put at BAD, the flag the line must name or "")
ENTRIES = {
    "txt2img --ckpt": (txt2img.main, lambda f, t: ["--ckpt", "BAD", *sample(f, t)], "--ckpt"),
    "txt2img --vae": (
        txt2img.main,
        lambda f, t: ["--ckpt", f["model"], "--vae", "BAD", *sample(f, t)],
        "--vae",
    ),
    "txt2img --lora": (
        txt2img.main,
        lambda f, t: ["--ckpt", f["model"], "--lora", "BAD", *sample(f, t)],
        "--lora",
    ),
    "convert ckpt": (convert.main, lambda f, t: ["BAD", t / "out.safetensors"], ""),
    "lora merge --lora": (
        lora_script.main,
        lambda f, t: [
            "merge",
            f["model"],
            t / "o.safetensors",
            "--config",
            CONFIG,
            "--lora",
            "BAD",
        ],
        "--lora",
    ),
    "swap_vae --vae": (
        swap_vae.main,
        lambda f, t: ["--vae", "BAD", "--out", t / "v.safetensors"],
        "--vae",
    ),
    "swap_vae --ckpt": (
        swap_vae.main,
        lambda f, t: ["--vae", f["model"], "--ckpt", "BAD", "--out", t / "v.safetensors"],
        "--ckpt",
    ),
    "evaluate --features": (
        evaluate.main,
        lambda f, t: [*evaluation(f, t), "--features", "BAD", *evaluation_rest(f, t)],
        "--features",
    ),
    "lora_concept --base-ckpt": (
        lora_concept.main,
        lambda f, t: ["--base-ckpt", "BAD", "--out", t / "concept"],
        "--base-ckpt",
    ),
    "fid_demo --features": (
        fid_demo.main,
        lambda f, t: ["--out", t / "fid", "--features", "BAD"],
        "--features",
    ),
}

# damaged file -> what the line says it is
DAMAGED = {  # (any of these)
    "empty.safetensors": ("an empty file (0 bytes)",),  # the family detector says it too
    "empty.ckpt": ("an empty file (0 bytes)",),
    "cut-in-header.safetensors": ("not a readable .safetensors file",),
    "cut-in-data.safetensors": ("not a readable .safetensors file",),
    "cut-early.ckpt": ("not a readable checkpoint (PytorchStreamReader failed",),
    "cut.ckpt": ("not a readable checkpoint (a zip archive cut short)",),  # was Errno 22
    "random.safetensors": ("not a readable .safetensors file",),
    "random.ckpt": ("not a readable checkpoint (not a torch checkpoint",),  # not "holds code"
    "random.pt": ("not a readable checkpoint (not a torch checkpoint",),
    "code.ckpt": ("refused to unpickle (it asks for posix.system)",),
    "code-pickle.ckpt": ("refused to unpickle (it asks for posix.system)",),
}


def argv_with(entry, files, tmp, bad):
    main, make, flag = ENTRIES[entry]
    return main, [bad if a == "BAD" else a for a in make(files, tmp)], flag


DAMAGED_CASES = [
    (entry, damaged)
    for entry in ENTRIES
    for damaged in DAMAGED
    if not entry.endswith("--lora") or damaged.endswith(".safetensors")  # LoRA files are
]


@pytest.mark.parametrize("entry, damaged", DAMAGED_CASES)
def test_a_damaged_or_refused_file_is_one_line_naming_it(files, tmp_path, capsys, entry, damaged):
    bad = files[damaged]
    main, argv, flag = argv_with(entry, files, tmp_path, bad)
    status, lines = script_outcome(main, argv, capsys)
    assert_one_line(status, lines, f"{flag} {bad}" if flag else str(bad))
    assert any(words in lines[0] for words in DAMAGED[damaged]), lines
    assert "Please file an issue" not in lines[0]  # torch's words for its own reader's limits
    assert not files["marker"].exists(), "the pickle's code ran"
    assert list(tmp_path.iterdir()) == []  # nothing made or written


# entry point -> (main, argv, the flag)
def missing_or_folder_entries(f, t):
    rest = evaluation_rest(f, t)
    return {
        "txt2img --ckpt": (txt2img.main, ["--ckpt", "BAD", *sample(f, t)]),
        "txt2img --vae": (txt2img.main, ["--ckpt", f["model"], "--vae", "BAD", *sample(f, t)]),
        "txt2img --lora": (txt2img.main, ["--ckpt", f["model"], "--lora", "BAD", *sample(f, t)]),
        "txt2img --config": (
            txt2img.main,
            ["--ckpt", f["model"], *sample(f, t), "--config", "BAD"],
        ),
        "txt2img --from-file": (
            txt2img.main,
            ["--ckpt", f["model"], *sample(f, t), "--from-file", "BAD"],
        ),
        "img2img --init-img": (
            img2img.main,
            ["--ckpt", f["model"], *sample(f, t), "--init-img", "BAD"],
        ),
        "swap_vae --vae": (swap_vae.main, ["--vae", "BAD", "--out", t / "v.safetensors"]),
        "swap_vae --ckpt": (
            swap_vae.main,
            ["--vae", f["model"], "--ckpt", "BAD", "--out", t / "v.safetensors"],
        ),
        "evaluate --prompts": (
            evaluate.main,
            [f["model"], "--base", CONFIG, "--prompts", "BAD", "--features", f["features"], *rest],
        ),
        "evaluate --base": (
            evaluate.main,
            [f["model"], "--prompts", f["prompts.txt"], "--features", f["features"], *rest]
            + ["--base", "BAD"],
        ),
        "lora_concept --base-ckpt": (lora_concept.main, ["--base-ckpt", "BAD", "--out", t / "c"]),
        "fid_demo --features": (fid_demo.main, ["--out", t / "fid", "--features", "BAD"]),
    }


MISSING_OR_FOLDER = [
    "txt2img --ckpt",
    "txt2img --vae",
    "txt2img --lora",
    "txt2img --config",
    "txt2img --from-file",
    "img2img --init-img",
    "swap_vae --vae",
    "swap_vae --ckpt",
    "evaluate --prompts",
    "evaluate --base",
    "lora_concept --base-ckpt",
    "fid_demo --features",
]


@pytest.mark.parametrize("given", ["missing", "a-folder"])
@pytest.mark.parametrize("entry", MISSING_OR_FOLDER)
def test_a_missing_path_or_a_folder_for_a_file_is_one_line_naming_the_flag(
    files, tmp_path, capsys, entry, given
):
    bad = tmp_path / "typo.safetensors" if given == "missing" else files["a-folder"]
    main, argv = missing_or_folder_entries(files, tmp_path)[entry]
    flag = entry.split()[1]
    status, lines = script_outcome(main, [bad if a == "BAD" else a for a in argv], capsys)
    # A folder is not "no such file" (it is there): the line says what it is.
    said = ("no such file", "not found") if given == "missing" else ("is a folder",)
    assert_one_line(status, lines)
    # evaluate's callback-shared lines name it `prompts=X` (lun.callbacks.evaluation)
    assert f"{flag} {bad}" in lines[0] or f"{flag[2:]}={bad}" in lines[0], lines
    assert any(words in lines[0] for words in said), lines
    assert list(tmp_path.iterdir()) == []


TEXT_CASES = {
    "config-is-a-checkpoint": ("--config", "model", "not a text file"),
    "from-file-is-a-checkpoint": ("--from-file", "model", "not a text file"),
    "from-file-is-empty": ("--from-file", "empty.ckpt", "no prompts in it"),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_a_text_flag_given_a_binary_or_empty_file_is_one_line(
    files, tmp_path, capsys, monkeypatch, case
):
    """A checkpoint as --config was UTF-8's "codec can't decode byte 0xe2" (no file named); an
    empty --from-file a torch.cat error after the output folder was made. Both are said before
    the model is built."""

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the file was checked")

    monkeypatch.setattr(generation, "instantiate_from_config", built)
    flag, name, words = TEXT_CASES[case]
    argv = ["--ckpt", files["model"], *sample(files, tmp_path), flag, files[name]]
    status, lines = script_outcome(txt2img.main, argv, capsys)
    assert_one_line(status, lines, f"{flag} {files[name]}", words)
    assert list(tmp_path.iterdir()) == []


# --- outputs: checked before anything is read -----------------------------------------------


def output_entries(f, t):
    """entry -> (main, argv with the output at OUT)"""
    convert_in = [f["model"]]
    rest = ["--features", f["features"], *evaluation_rest(f, t)]
    return {
        "convert out": (convert.main, [*convert_in, "OUT"]),
        "convert --to-diffusers": (convert.main, [*convert_in, "--to-diffusers", "OUT"]),
        "lora merge out": (
            lora_script.main,
            ["merge", f["model"], "OUT", "--config", CONFIG, "--lora", f["lora"]],
        ),
        "swap_vae --out": (swap_vae.main, ["--vae", f["model"], "--out", "OUT"]),
        "swap_vae --to-diffusers": (swap_vae.main, ["--vae", f["model"], "--to-diffusers", "OUT"]),
        "txt2img --outdir": (
            txt2img.main,
            ["--ckpt", f["model"], *sample(f, t), "--outdir", "OUT"],
        ),
        "evaluate --out": (evaluate.main, [*evaluation(f, t), *rest, "--out", "OUT"]),
        "evaluate --cache-dir": (evaluate.main, [*evaluation(f, t), *rest, "--cache-dir", "OUT"]),
        "eval_shapes --grid": (
            eval_shapes.main,
            ["--ckpt", f["model"], "--config", CONFIG, "--grid", "OUT"],
        ),
        "fid_demo --out": (fid_demo.main, ["--out", "OUT"]),
        "lora_concept --out": (lora_concept.main, ["--base-ckpt", f["model"], "--out", "OUT"]),
        "demo --logdir": (demo.main, ["--data", t / "data", "--logdir", "OUT"]),
    }


FILE_OUTPUTS = {  # the suffix each writes
    "convert out": ".safetensors",
    "lora merge out": ".safetensors",
    "swap_vae --out": ".safetensors",
    "evaluate --out": ".json",
    "eval_shapes --grid": ".png",
}
FOLDER_OUTPUTS = [
    "convert --to-diffusers",
    "swap_vae --to-diffusers",
    "txt2img --outdir",
    "evaluate --cache-dir",
    "fid_demo --out",
    "lora_concept --out",
    "demo --logdir",
]


def output_cases():
    for entry, suffix in FILE_OUTPUTS.items():
        yield entry, "is-a-folder", lambda f, t, s=suffix: f[f"folder{s}"], "is a folder"
        yield entry, "parent-is-a-file", lambda f, t, s=suffix: f["a-file"] / f"x{s}", "is a file"
        yield entry, "parent-missing", lambda f, t, s=suffix: t / "no" / f"x{s}", "no folder"
    for entry in FOLDER_OUTPUTS:
        yield entry, "is-a-file", lambda f, t: f["a-file"], "is a file; give a folder"
        yield entry, "parent-is-a-file", lambda f, t: f["a-file"] / "x", "is a file, not a folder"
    for entry, name in [("convert out", "x.safetnesors"), ("lora merge out", "x.ckpt")]:
        yield entry, "wrong-suffix", lambda f, t, n=name: t / n, "file name"


OUTPUT_CASES = list(output_cases())


@pytest.mark.parametrize(
    "entry, kind, make, words", OUTPUT_CASES, ids=[f"{c[0]}-{c[1]}" for c in OUTPUT_CASES]
)
def test_an_output_path_that_cannot_be_written_is_one_line_before_anything_is_read(
    files, tmp_path, capsys, entry, kind, make, words
):
    """These were tracebacks (swap_vae), exit status 1 after the work (convert: 'Is a
    directory (x.safetensors.tmp)'), or after a whole evaluation (evaluate --out); convert's
    `x.safetnesors` silently got a pickle, lora.py's `x.ckpt` a safetensors file."""
    out = make(files, tmp_path)
    main, argv = output_entries(files, tmp_path)[entry]
    status, lines = script_outcome(main, [out if a == "OUT" else a for a in argv], capsys)
    assert_one_line(status, lines, str(out), words)
    assert list(tmp_path.iterdir()) == []
    assert files["a-file"].read_text() == "not a folder\n"


# --- nothing is lost ------------------------------------------------------------------------


def test_new_images_never_replace_an_earlier_runs(files, tmp_path, capsys):
    """The next number came from counting the PNGs: with 00000.png and 00002.png there (one
    deleted), the count 2 overwrote 00002.png."""
    samples = tmp_path / "out" / "samples"
    samples.mkdir(parents=True)
    for name in ("00000.png", "00002.png"):
        (samples / name).write_bytes(b"an earlier image")
    (tmp_path / "out" / "grid-0001.png").write_bytes(b"an earlier grid")
    txt2img.main([str(a) for a in ["--ckpt", files["model"], *sample(files, tmp_path)]])
    assert sorted(p.name for p in samples.iterdir()) == ["00000.png", "00002.png", "00003.png"]
    assert (samples / "00002.png").read_bytes() == b"an earlier image"
    assert (tmp_path / "out" / "grid-0001.png").read_bytes() == b"an earlier grid"
    assert (tmp_path / "out" / "grid-0002.png").is_file()


def test_a_failed_folder_export_leaves_the_earlier_folder_whole(
    files, tmp_path, capsys, monkeypatch
):
    """--to-diffusers into an earlier export: a write that fails half-way (a full disk) leaves
    the earlier folder as it was, not half of its files replaced; a good one replaces the
    export's files and keeps the user's own."""
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text("earlier")
    (folder / "notes.txt").write_text("mine")
    save = checkpoint.save_safetensors

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_safetensors", full_disk)
    status, lines = script_outcome(
        swap_vae.main, ["--vae", files["model"], "--to-diffusers", folder], capsys
    )
    assert status == 1 and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae"]  # no temporary left
    assert (folder / "config.json").read_text() == "earlier"
    assert (folder / "notes.txt").read_text() == "mine"

    monkeypatch.setattr(checkpoint, "save_safetensors", save)
    assert swap_vae.main([str(a) for a in ["--vae", files["model"], "--to-diffusers", folder]]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "notes.txt",
    ]
    assert (folder / "config.json").read_text() != "earlier"
    assert (folder / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae"]


@pytest.mark.parametrize("suffix", [".safetensors", ".ckpt"])
def test_a_failed_convert_keeps_the_earlier_output_and_the_users_tmp_file(
    files, tmp_path, capsys, monkeypatch, suffix
):
    """The output is written aside and renamed: a full disk half-way leaves the earlier file
    whole. The aside name is hidden and unique: it was `out.safetensors.tmp`, which replaced
    (and on failure deleted) a user's own file of that name."""
    out = tmp_path / f"out{suffix}"
    out.write_bytes(b"earlier")
    users = tmp_path / f"out{suffix}.tmp"
    users.write_bytes(b"mine")
    real_open = open

    def full_disk_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if "w" in mode:

            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")

            file.write = write
        return file

    target = checkpoint if suffix == ".safetensors" else convert
    monkeypatch.setattr(target, "open", full_disk_open, raising=False)
    status, lines = script_outcome(convert.main, [files["model"], out], capsys)
    assert status == 1 and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert out.read_bytes() == b"earlier" and users.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, users.name])


def test_a_text_written_atomically_keeps_the_old_one_when_the_write_fails(tmp_path):
    results = tmp_path / "eval.json"
    results.write_text("earlier results")
    with pytest.raises(UnicodeEncodeError):
        generation.write_text_atomically(results, "half \ud800")  # fails while writing
    assert results.read_text() == "earlier results"
    assert list(tmp_path.iterdir()) == [results]
    generation.write_text_atomically(results, "new")
    assert results.read_text() == "new" and list(tmp_path.iterdir()) == [results]


# --- main.py: --resume and model.params.ckpt_path ---------------------------------------------

LAUNCHER_CASES = {
    "resume-random-bytes": ("--resume", "random.ckpt", "not a readable checkpoint"),
    "resume-cut-zip": ("--resume", "cut.ckpt", "a zip archive cut short"),
    "resume-empty": ("--resume", "empty.ckpt", "not a readable checkpoint"),
    "resume-pickle-with-code": ("--resume", "code-pickle.ckpt", "refused to unpickle"),
    "ckpt-path-random-bytes": ("ckpt_path", "random.ckpt", "not a readable checkpoint"),
    # found only when the model was built, after the data was indexed
    "vae-path-random-bytes": ("first_stage_config.params.ckpt_path", "random.ckpt", "readable"),
    "vae-path-a-lora": ("first_stage_config.params.ckpt_path", "lora", "expected a VAE"),
    "ckpt-path-diffusers-folder-without-vae": (
        "ckpt_path",
        "pipeline-without-vae",
        "vae/config.json: missing",
    ),
}


@pytest.mark.parametrize("case", list(LAUNCHER_CASES))
def test_the_launcher_names_a_damaged_checkpoint_in_one_line(
    files, tmp_path, shapes_dir, monkeypatch, case
):
    """--resume of a damaged file was a traceback (its check raised a ValueError main.py does
    not catch). Each is said before the data is indexed (docs/errors.md)."""
    import lun.trainer

    def indexed(*args, **kwargs):
        raise AssertionError("the data was indexed before the file was checked")

    monkeypatch.setattr(lun.trainer, "build_data", indexed)
    how, name, words = LAUNCHER_CASES[case]
    given = (
        ["--resume", files[name]] if how == "--resume" else [f"model.params.{how}={files[name]}"]
    )
    args = ["--base", CONFIG, f"data.params.train.params.data_root={shapes_dir}", *given]
    result = run_main_here([*args, "-l", tmp_path / "logs", "-t"], tmp_path)
    lines = [line for line in result.stderr.splitlines() if "lun.run: resuming from" not in line]
    assert_one_line(result.returncode, lines, str(files[name]), words)
    assert not (tmp_path / "logs").exists()
    assert not files["marker"].exists()
