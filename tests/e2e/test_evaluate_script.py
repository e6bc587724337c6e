"""scripts/evaluate.py: FID / KID / CLIP score of a run's checkpoint, table and JSON."""

import importlib.util
import json

import pytest
from eval_helpers import make_clip_folder, make_small_features
from run_helpers import ROOT


def load_evaluate():
    spec = importlib.util.spec_from_file_location(
        "evaluate_script", ROOT / "scripts" / "evaluate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the session's trained run, then two evaluations
def test_evaluate_scores_ema_and_raw_weights_and_reuses_the_reference(
    tmp_path, trained_run, shapes_dir, capsys
):
    evaluate = load_evaluate()
    (ckpt,) = [p for p in (trained_run / "checkpoints").glob("*.ckpt") if not p.is_symlink()]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    common = [
        str(ckpt),
        "--prompts", str(prompts),
        "--reference", str(shapes_dir / "images"),
        "--features", str(make_small_features(tmp_path / "f.safetensors", size=32)),
        "--clip", str(make_clip_folder(tmp_path / "clip", image_size=16)),
        "--num-images", "6", "--batch-size", "4", "--steps", "2",
        "--kid-subsets", "3", "--kid-subset-size", "4",
        "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
    ]  # fmt: skip
    evaluate.main([*common, "--ema", "--out", str(tmp_path / "ema.json")])
    first = capsys.readouterr().out
    evaluate.main([*common, "--no-ema", "--out", str(tmp_path / "raw.json")])
    second = capsys.readouterr().out
    assert "reference: 16 images (computed" in first and "reference: 16 images (cached" in second
    ema = json.loads((tmp_path / "ema.json").read_text())["results"][0]
    raw = json.loads((tmp_path / "raw.json").read_text())["results"][0]
    for row in (ema, raw):
        assert row["num_images"] == 6 and row["fid"] > 0 and row["kid_std"] >= 0
        assert 0 <= row["clip_score"] <= 100
    assert ema["fid"] != raw["fid"]  # the EMA weights are other weights
    assert f"{ema['fid']:9.3f}" in first  # the printed table


@pytest.mark.parametrize(
    "change, message",
    [
        (["--features", "missing.pth"], "error: --features=missing.pth: feature-extractor weights not found"),
        (["--reference", "no-such-dir"], "error: --reference=no-such-dir: no such folder"),
        (["--prompts", "none.txt"], "error: prompts=none.txt: prompt file not found"),
    ],
)  # fmt: skip
def test_evaluate_names_a_missing_file_in_one_line(tmp_path, shapes_dir, capsys, change, message):
    evaluate = load_evaluate()
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    args = {
        "--prompts": str(prompts),
        "--reference": str(shapes_dir),
        "--features": str(make_small_features(tmp_path / "f.safetensors", size=16)),
    }
    args[change[0]] = change[1]
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["some.ckpt", *[x for kv in args.items() for x in kv]])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
