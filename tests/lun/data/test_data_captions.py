"""Caption files in any encoding a person's tools write are read as the text they hold; what cannot
be read cleanly is counted and reported, never silently turned into replacement characters."""

import json
import logging

import pytest
import torch

from lun.data.local import Local
from lun.data.report import LEGACY, UNDECODABLE, decode_text

TEXT = "café “naïve” résumé"  # the quotes exist in cp1252, not in latin-1


@pytest.mark.parametrize(
    ("raw", "text", "problem"),
    [
        (TEXT.encode("utf-8"), TEXT, None),
        (b"\xef\xbb\xbf" + TEXT.encode("utf-8"), TEXT, None),  # UTF-8 with a byte-order mark
        (TEXT.encode("utf-16"), TEXT, None),  # BOM + native order (little-endian here)
        (b"\xfe\xff" + TEXT.encode("utf-16-be"), TEXT, None),
        (b"\xff\xfe" + TEXT.encode("utf-16-le"), TEXT, None),
        (b"\xff\xfe\x00\x00" + TEXT.encode("utf-32-le"), TEXT, None),  # not UTF-16 + U+0000
        ("a red circle".encode("utf-16-le"), "a red circle", None),  # UTF-16 without a mark
        ("a red circle".encode("utf-16-be"), "a red circle", None),
        (TEXT.encode("cp1252"), TEXT, LEGACY),
        ("café crème".encode("latin-1"), "café crème", LEGACY),
        (b"caf\xe9 \x81", "café \ufffd", UNDECODABLE),  # 0x81 is unassigned in cp1252
        (b"\xef\xbb\xbfcaf\xe9", "caf\ufffd", UNDECODABLE),  # says UTF-8, is not
        (b"\xff\xfe" + "ab".encode("utf-16-le") + b"c", "ab\ufffd", UNDECODABLE),  # odd length
    ],
    ids=[
        "utf-8",
        "utf-8-bom",
        "utf-16-bom",
        "utf-16-be-bom",
        "utf-16-le-bom",
        "utf-32-le-bom",
        "utf-16-le-no-bom",
        "utf-16-be-no-bom",
        "cp1252",
        "latin-1",
        "undecodable-cp1252",
        "bad-utf-8-after-bom",
        "truncated-utf-16",
    ],
)
def test_decode_text(raw, text, problem):
    assert decode_text(raw) == (text, problem)


def write_captions(root, writers, captions: dict) -> None:
    for name, raw in captions.items():
        writers.save(root / "images" / f"{name}.png", size=(16, 16))
        (root / "captions" / f"{name}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / "captions" / f"{name}.txt").write_bytes(raw)


CAPTIONS = {
    "a_utf16": "\ufeffa UTF-16 caption: ünï".encode("utf-16-le"),
    "b_latin1": "a latin-1 caption: café".encode("latin-1"),
    "c_utf8bom": "\ufeffa UTF-8 caption with a mark: ✓".encode(),
    "d_undecodable": b"broken \x81 bytes",
    "e_plain": b"plain ascii",
}
EXPECTED = [
    "a UTF-16 caption: ünï",
    "a latin-1 caption: café",
    "a UTF-8 caption with a mark: ✓",
    "broken \ufffd bytes",
    "plain ascii",
]


def test_local_reads_each_encoding_and_counts_what_was_not_clean(tmp_path, writers, caplog):
    write_captions(tmp_path, writers, CAPTIONS)
    with caplog.at_level(logging.INFO, logger="lun.data"):
        dataset = Local(str(tmp_path), size=8, cache_dir=False)
        for _ in range(2):  # two epochs: each file is named once
            assert [dataset[i]["caption"] for i in range(len(dataset))] == EXPECTED
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note ")]
    assert notes == [
        f"note {tmp_path}/captions/b_latin1.txt: {LEGACY}",
        f"note {tmp_path}/captions/d_undecodable.txt: {UNDECODABLE}",
    ]
    assert dataset.bad_input.summarize_epoch("after epoch 1") == (
        f"{tmp_path}: after epoch 1, 1 caption file with {LEGACY}; "
        f"1 caption file with {UNDECODABLE} (each is named once above)"
    )


def test_caption_notes_made_in_loader_workers_reach_the_summary(tmp_path, writers):
    write_captions(tmp_path, writers, {**CAPTIONS, "f_latin1": "naïve".encode("latin-1")})
    dataset = Local(str(tmp_path), size=8, cache_dir=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2)
    captions = [c for batch in loader for c in batch["caption"]]
    assert captions == [*EXPECTED, "naïve"]
    summary = dataset.bad_input.summarize_epoch("at the end")  # in this (the main) process
    assert f"2 caption files with {LEGACY}; 1 caption file with {UNDECODABLE}" in summary


def test_metadata_json_in_utf16_or_latin1_is_read_and_a_legacy_one_noted(tmp_path, writers):
    meta = tmp_path / "metadata"
    meta.mkdir()
    for i, encoding in enumerate(["utf-16", "latin-1", "utf-8"]):
        writers.save(tmp_path / "images" / f"{i}.png", size=(16, 16))
        text = json.dumps({"tags": ["café", encoding], "score": 1, "path": f"images/{i}.png"})
        (meta / f"{i}.json").write_bytes(
            json.dumps(json.loads(text), ensure_ascii=False).encode(encoding)
        )
    dataset = Local(str(tmp_path), size=8, cache_dir=False, metadata_params={})
    assert [dataset.caption(i) for i in range(3)] == [
        "café, utf-16",
        "café, latin-1",
        "café, utf-8",
    ]
    assert dataset.bad_input.describe() == f"1 with {LEGACY}"
