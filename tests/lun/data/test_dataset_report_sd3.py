"""The dataset report's T5 token counts (SD 3/3.5's third text encoder, 256 tokens) beside the
CLIP ones, from the tokenizer folder the model config names.

The tokenizer is a tiny T5 one built here offline (a Unigram model whose pieces are whole words,
T5's `</s>` appended, no start token), so a caption of k words is k + 1 tokens - counted by hand.
"""

import pytest
from PIL import Image

from lun.data.dataset_report import build_report, summary

WORDS = [3, 255, 256, 300]  # -> 4, 256 (fits), 257 and 301 tokens (cut at 256)


def quiet(iterable, **_):
    return iterable


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581w{i}", -1.0) for i in range(400)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    folder = tmp_path_factory.mktemp("t5") / "t5-tokenizer"
    T5TokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    root = tmp_path_factory.mktemp("captioned")
    for n, words in enumerate(WORDS):
        Image.new("RGB", (32, 32), (60 * n, 0, 0)).save(root / f"{n}.png")
        (root / f"{n}.txt").write_text(" ".join(f"w{i}" for i in range(words)))
    return root


def config(root, conditioner: dict) -> dict:
    train = {"target": "lun.data.local.Local", "params": {"data_root": str(root), "size": 32}}
    return {
        "model": {
            "target": "ldm.diffusion.LatentDiffusion",
            "params": {"conditioner_config": conditioner},
        },
        "data": {"target": "lun.data.DataModule", "params": {"batch_size": 1, "train": train}},
    }


def tokens_of(report) -> dict:
    (split,) = report["splits"]
    return {t["encoder"]: t for t in split["captions"]["tokens"]}


@pytest.mark.slow  # the first to import transformers' tokenizers and build CLIP's BPE one
def test_t5_lengths_and_captions_over_256_beside_clip(captioned, t5_folder):
    """configs/sd3's shape: SD3Conditioner's t5xxl names its tokenizer folder, t5_tokens 256."""
    conditioner = {
        "target": "ldm.conditioning_sd3.SD3Conditioner",
        "params": {"t5_tokens": 256, "t5xxl": {"tokenizer": str(t5_folder)}},
    }
    report = build_report(config(captioned, conditioner), progress=quiet)
    found = tokens_of(report)
    where = "model.params.conditioner_config"
    for clip in ("clip_l", "clip_g"):
        assert found[f"{where}.params.{clip} (CLIP)"]["max_length"] == 77
    t5 = found[f"{where} (FrozenT5Embedder)"]
    assert t5["max_length"] == 256
    assert sorted(t5["lengths"]) == [w + 1 for w in WORDS]  # the words and T5's </s>
    assert t5["truncated"] == 2  # 257 and 301 tokens; 256 fits
    assert "2 over 256 (truncated)" in summary({**report, "config": "sd3.yaml"})


def test_a_t5_encoder_with_its_own_folder_and_limit(captioned, t5_folder):
    conditioner = {
        "target": "ldm.text_encoder_t5.FrozenT5Embedder",
        "params": {"version": str(t5_folder), "max_length": 4},
    }
    (t5,) = tokens_of(build_report(config(captioned, conditioner), progress=quiet)).values()
    assert t5["max_length"] == 4 and t5["truncated"] == 3  # only the 3-word caption fits


def test_a_missing_t5_folder_is_said_and_the_report_goes_on(captioned, tmp_path):
    conditioner = {
        "target": "ldm.conditioning_sd3.SD3Conditioner",
        "params": {"t5xxl": {"tokenizer": str(tmp_path / "no-t5")}},
    }
    report = build_report(config(captioned, conditioner), progress=quiet)
    t5 = tokens_of(report)["model.params.conditioner_config (FrozenT5Embedder)"]
    assert "model.params.conditioner_config.params.t5xxl.tokenizer" in t5["error"]
    assert "no-t5" in t5["error"]
    assert report["splits"][0]["counts"]["usable"] == len(WORDS)
    without = {"target": "ldm.conditioning_sd3.SD3Conditioner", "params": {"t5xxl": None}}
    found = tokens_of(build_report(config(captioned, without), progress=quiet))
    assert not [name for name in found if "T5" in name]  # no T5: CLIP's counts only
