"""The dataset report (lun.data.dataset_report): its counts equal what the generation parameters
say each rule must drop; captions, scores, buckets, decoded images; the HTML page renders."""

import json
import logging
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from make_metadata_set import PARAMS, make_metadata_set
from PIL import Image

import main as launcher
from lun.data.dataset_report import build_report, main, near_duplicate_groups

# Considered files per fate (scripts/make_metadata_set.py), 10,000 in all; every second file of
# the 20,000 is passed over by consider_every_nth. Unequal counts, so a swapped reason shows.
FATES = {
    "ok": 5000,
    "empty": 300,
    "long": 40,
    "rescued": 410,
    "wide": 700,
    "abs_min": 520,
    "black_a": 630,
    "black_b": 240,
    "min_score": 350,
    "sunk": 160,
    "aspect": 270,
    "outside": 330,
    "missing": 190,
    "zero_byte": 110,
    "malformed": 420,
    "no_score": 330,
}
BATCH, WORLD = 4, 3


def quiet(iterable, **_):
    return iterable


def metadata_config(root, **dataset) -> dict:
    train = {
        "target": "lun.data.local.Local",
        "params": {"data_root": str(root), "size": 512, "cache_dir": False, **dataset},
    }
    return {
        "model": {
            "target": "ldm.diffusion.LatentDiffusion",
            "params": {
                "cond_stage_config": {"target": "ldm.modules.encoders.modules.FrozenCLIPEmbedder"}
            },
        },
        "data": {"target": "lun.data.DataModule", "params": {"batch_size": BATCH, "train": train}},
    }


@pytest.mark.slow  # 20,000 files written and indexed: ~4 s on a quiet machine
def test_counts_equal_the_generation_parameters_for_every_rule(tmp_path, caplog):
    make_metadata_set(tmp_path, FATES, every_nth=PARAMS["consider_every_nth"])
    config = metadata_config(tmp_path, metadata_params=PARAMS, buckets={"step": 64})
    with caplog.at_level(logging.INFO, logger="lun.data"):
        report = build_report(config, world_size=WORLD, progress=quiet)
    (split,) = report["splits"]
    counts = split["counts"]

    # Independently of the code: each fate meets one rule (the first that applies, for abs_min
    # items that also carry a blacklisted tag), and files between every 2nd are never read.
    total = 2 * sum(FATES.values())
    usable = sum(FATES[f] for f in ("ok", "empty", "long", "rescued", "wide"))
    expected_dropped = {
        "not every nth (consider_every_nth=2)": total // 2,
        "missing field": FATES["no_score"],
        "malformed JSON": FATES["malformed"],
        "path outside data_root": FATES["outside"],
        "image not found": FATES["missing"],
        "zero-byte image": FATES["zero_byte"],
        "below abs_min_score": FATES["abs_min"],
        "blacklisted tag 'bad_a'": FATES["black_a"],
        "blacklisted tag 'bad_b'": FATES["black_b"],
        "below min_score after bonuses": FATES["min_score"] + FATES["sunk"],
        "outside aspect_range": FATES["aspect"],
    }
    assert counts["found"] == total
    assert counts["dropped"] == expected_dropped
    assert counts["usable"] == split["items"] == usable
    assert counts["indexed"] == usable + sum(
        FATES[f] for f in ("abs_min", "black_a", "black_b", "min_score", "sunk", "aspect")
    )
    assert counts["noted"] == {}
    assert len(counts["examples"]["path outside data_root"]) == 5

    captions = split["captions"]
    assert captions["count"] == usable and captions["empty"] == FATES["empty"]
    (tokens,) = captions["tokens"]  # the CLIP tokenizer of the one text encoder
    assert tokens["max_length"] == 77 and tokens["truncated"] == FATES["long"]
    top = dict(captions["top_words"])
    assert top["good"] == FATES["rescued"]  # only rescued items carry it, all of them kept

    scores = split["scores"]
    raw, with_bonus = np.array(scores["raw"]), np.array(scores["with_bonus"])
    assert (raw < PARAMS["abs_min_score"]).sum() == FATES["abs_min"]
    assert (with_bonus < PARAMS["min_score"]).sum() == (
        FATES["abs_min"] + FATES["min_score"] + FATES["sunk"]  # abs_min items score 1 + 0
    )
    assert (raw < PARAMS["min_score"]).sum() - (with_bonus < PARAMS["min_score"]).sum() == (
        FATES["rescued"] - FATES["sunk"]
    )

    buckets = split["buckets"]
    per_bucket = sorted(b["images"] for b in buckets["buckets"] if b["images"])
    square, wide = usable - FATES["wide"], FATES["wide"]
    assert per_bucket == sorted([square, wide])
    steps = math.ceil((math.ceil(square / BATCH) + math.ceil(wide / BATCH)) / WORLD)
    assert [r["steps"] for r in buckets["ranks"]] == [steps] * WORLD
    assert buckets["dropped"] == 0
    assert buckets["repeated"] == steps * WORLD * BATCH - usable

    # The same counts, one line each, where the DataModule builds the split (start of a run).
    logged = [r.getMessage() for r in caplog.records]
    assert f"data.train: found {total}" in logged
    assert f"data.train: dropped {FATES['black_a']} blacklisted tag 'bad_a'" in logged
    assert f"data.train: indexed {counts['indexed']}, usable {usable}" in logged


def _noise(rng, height, width, channels=3) -> Image.Image:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


def _flat_set(root: Path) -> None:
    """A small flat-file set meeting each image and caption problem once."""
    images, captions = root / "images", root / "captions"
    images.mkdir(parents=True)
    captions.mkdir()
    rng = np.random.default_rng(0)
    photo = _noise(rng, 48, 64).resize((128, 96), Image.Resampling.BILINEAR)
    photo.save(images / "a.png")
    shutil.copy(images / "a.png", images / "a_copy.png")  # an exact duplicate
    photo.resize((200, 150), Image.Resampling.BICUBIC).save(images / "a_big.jpg", quality=85)
    _noise(rng, 64, 64).save(images / "b.png")
    _noise(rng, 80, 40, 4).save(images / "rgba.png")
    _noise(rng, 30, 60).convert("CMYK").save(images / "cmyk.jpg")
    gray16 = rng.integers(0, 65536, (32, 32)).astype(np.uint16)
    Image.fromarray(gray16).save(images / "gray16.png")
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    (images / "zero.png").write_bytes(b"")
    for name in ("a", "a_copy", "rgba", "cmyk", "broken", "zero"):  # a_big has none
        (captions / f"{name}.txt").write_text(f"a picture, {name}, red", encoding="utf-8")
    (captions / "b.txt").write_bytes("caf\xe9 au lait".encode("cp1252"))  # not UTF-8
    (captions / "gray16.txt").write_text("", encoding="utf-8")  # an empty caption


@pytest.fixture(scope="module")
def flat_report(tmp_path_factory):
    """main(--decode) on the flat set: (report.json, out folder)."""
    root = tmp_path_factory.mktemp("flat")
    _flat_set(root / "data")
    config = metadata_config(root / "data")
    config["data"]["params"]["batch_size"] = 3
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    out = root / "report"
    status = main(["--base", str(root / "config.yaml"), "--decode", "--out", str(out)])
    assert status == 0
    return json.loads((out / "report.json").read_text()), out


def test_decoded_images_modes_duplicates_and_unreadable_files(flat_report):
    report, out = flat_report
    (split,) = report["splits"]
    counts = split["counts"]
    assert counts["found"] == 9 and counts["dropped"] == {"zero bytes": 1}
    assert counts["usable"] == 8 and counts["unreadable_at_load"] == 1
    assert counts["noted"] == {"no caption (trained with an empty caption)": 1}
    assert counts["examples"]["unreadable at load"][0].endswith("broken.png")

    images = split["images"]
    assert images["decoded"] == 7 and images["unreadable"][0]["path"].endswith("broken.png")
    assert images["modes"] == {"RGB": 4, "RGBA": 1, "CMYK": 1, "16-bit": 1}
    assert sorted(zip(images["widths"], images["heights"])) == sorted(
        [(128, 96), (128, 96), (200, 150), (64, 64), (40, 80), (60, 30), (32, 32)]
    )
    names = [sorted(Path(p).name for p in group) for group in images["exact_duplicates"]]
    assert names == [["a.png", "a_copy.png"]]
    near = [sorted(Path(p).name for p in group) for group in images["near_duplicates"]]
    assert near == [["a.png", "a_big.jpg", "a_copy.png"]]  # resized and recompressed
    assert len(images["slowest"]) == 7

    captions = split["captions"]
    assert captions["empty"] == 2  # gray16's empty file, a_big's missing one
    assert captions["not_clean_utf8"] == {"not UTF-8 (read as cp1252)": 1}
    assert split["buckets"]["smaller_than_batch"] == []  # one bucket of 8 >= 3
    assert (out / "summary.txt").read_text().startswith("dataset report of")


def test_the_headline_counts_what_decode_could_read(flat_report):
    """9 files: zero.png dropped at indexing, broken.png indexed but not decodable: 7."""
    report, out = flat_report
    (split,) = report["splits"]
    assert split["items"] == 7
    head = "data.train (Local): 7 usable items (1 of the 8 indexed could not be decoded)"
    assert head in (out / "summary.txt").read_text().splitlines()


def test_near_duplicate_groups_by_hamming_distance():
    base = 0x0123_4567_89AB_CDEF
    hashes = [base, base ^ 0b1011, base ^ (1 << 63), ~base & (2**64 - 1), base ^ 0xFF00]
    # 3 bits and 1 bit from base: one group; 8 bits away and the complement: alone. Leaders, not
    # chains: hashes 2 bits apart in a row pair up instead of making one group.
    assert near_duplicate_groups(hashes, max_bits=3) == [[0, 1, 2]]
    assert near_duplicate_groups(hashes, max_bits=0) == []
    chain = [0]
    for k in range(6):
        chain.append(chain[-1] ^ (0b11 << (2 * k)))
    assert near_duplicate_groups(chain, max_bits=3) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.slow  # a headless browser start
def test_html_page_renders_its_plots_in_chromium(flat_report, tmp_path):
    """Each <img> decodes (naturalWidth > 0) and the page raises no error, in headless Chromium:
    a copy of the page carries a script that writes what it found into the DOM."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not on PATH (CI installs it: apt-get install chromium)")
    page = (flat_report[1] / "report.html").read_text(encoding="utf-8")
    probe = """<script>
    window.__errors = [];
    window.addEventListener('error', e => window.__errors.push(String(e.message || e.target.src)), true);
    window.addEventListener('load', () => {
      const images = [...document.images];
      const bad = images.filter(i => !(i.complete && i.naturalWidth > 0)).length;
      const out = document.createElement('pre');
      out.id = 'probe';
      out.textContent = JSON.stringify({images: images.length, bad, errors: window.__errors});
      document.body.appendChild(out);
    });
    </script>"""
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("<head>", "<head>" + probe, 1), encoding="utf-8")
    result = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probed.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = result.stdout
    assert 'id="probe"' in dom, result.stderr[-2000:]
    found = json.loads(dom.split('id="probe">', 1)[1].split("</pre>", 1)[0])
    # tokens, buckets, widths, heights, aspect, modes: every plot the page holds
    assert found["images"] == page.count("<img ") >= 6
    assert found["bad"] == 0 and found["errors"] == []


def test_bad_input_is_one_line_and_exit_2_before_any_report(tmp_path, capsys):
    config = metadata_config(tmp_path / "nowhere")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    assert main(["--base", str(tmp_path / "c.yaml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data_root" in err[0] and err[0].startswith("config error")
    assert not out.exists()
    assert main(["--base", str(tmp_path / "c.yaml"), "--world-size", "0"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_main_py_inspect_reads_a_shipped_config_without_its_checkpoint(tmp_path, shapes_dir):
    """`main.py --inspect` on v1-finetune.yaml: the model's `ckpt_path: ???` does not matter to a
    report on the data; the text encoder's tokenizer is found in the model config."""
    out = tmp_path / "out"
    argv = [
        "--inspect",
        "--base",
        str(Path(launcher.__file__).parent / "configs" / "stable-diffusion" / "v1-finetune.yaml"),
        f"data.params.train.params.data_root={shapes_dir}",
        "--out",
        str(out),
    ]
    assert launcher.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    split = report["splits"][0]
    assert split["counts"]["usable"] == 16
    assert split["captions"]["tokens"][0]["encoder"].endswith("(FrozenCLIPEmbedder)")
    assert not (tmp_path / "logs").exists()
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
