"""scripts/fid_demo.py finds the run it just trained, also when --out holds earlier runs."""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import fid_demo  # noqa: E402


def test_a_second_run_in_the_same_out_folder_is_the_one_scored(monkeypatch, tmp_path):
    made = []

    def fake_main(args):  # main.py's one visible effect here: a new run folder under `-l`
        logs = Path(args[args.index("-l") + 1])
        made.append(logs / f"2026-11-27T00-00-0{len(made)}_shapes")
        made[-1].mkdir(parents=True)

    monkeypatch.setattr(fid_demo, "run", fake_main)
    args = argparse.Namespace(
        config=[], max_steps=2, every=1, images=4, sampler="euler", sampling_steps=2, batch_size=2
    )
    first = fid_demo.train(tmp_path, tmp_path / "features.safetensors", args)
    second = fid_demo.train(tmp_path, tmp_path / "features.safetensors", args)
    assert (first, second) == (made[0], made[1])
