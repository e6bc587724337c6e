"""A LoRA run resumes exactly: N straight steps equal k steps + kill -9 + `--resume` + N - k steps,
bit for bit, in the adapter weights, the optimizer's moments and the EMA of the adapters; then a
resume with a longer schedule follows the config. This is the suite's single-process resume (one
process, killed at an epoch's end); tests/e2e/test_resume.py resumes full weights on 2 processes.

tests/e2e/test_resume.py's launcher runs (demo config made tiny, caption dropout, flips, offset
noise, warm-up + cosine, EMA, AdamW) with LoRA, LoCon and DoRA on the UNet and LoRA on the text
encoder, from a "pretrained" base (`ckpt_path`: a from-scratch UNet's zero output layer would
give the adapters no gradient, and DoRA's row norms of zero-initialised layers are 0). Its helper
compares the EMA, optimizer state and step; this file the adapters (`lora.*`)."""

import pytest
import torch
from lora_helpers import build
from run_helpers import run_main_here
from test_resume import (
    AT_EPOCH_END,
    DEMO,
    assert_a_longer_resume_follows_the_config,
    assert_resume_is_exact,
)

from ldm import checkpoint

LORA = "{rank: 2, alpha: 4, targets: [attn, ff, conv], dora: true, text_encoder: {rank: 2}}"
SHAPE = "model.params.unet_config.params.channel_mult=[1,2]"  # as test_resume's demo_args


def adapters(run) -> tuple[dict, dict]:
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {k: v for k, v in saved["state_dict"].items() if k.startswith("lora.")}, saved


@pytest.mark.slow
def test_lora_resume_is_bitwise_exact_and_a_longer_resume_follows_the_config(tmp_path, shapes_dir):
    base = tmp_path / "base.safetensors"
    checkpoint.save_safetensors(build(DEMO, None, overrides=(SHAPE,)).state_dict(), base)
    extra = (f"model.params.lora={LORA}", f"model.params.ckpt_path={base}")
    resumed = assert_resume_is_exact(tmp_path, shapes_dir, AT_EPOCH_END, *extra, side_by_side=True)
    (straight,) = (tmp_path / "straight").iterdir()

    got, saved = adapters(resumed)
    expected, _ = adapters(straight)
    assert got.keys() == expected.keys()
    assert {k.split(".")[-2] for k in got} == {"lora_A", "lora_B", "lora_magnitude_vector"}
    assert any(k.startswith("lora.cond_stage_model.") for k in got)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} adapter tensors differ, e.g. {differ[:3]}"
    # The adapters trained (B left its zero start everywhere), and only they are optimized.
    ups = [v for k, v in got.items() if k.endswith("lora_B.weight")]
    assert all(v.abs().max() > 0 for v in ups)
    assert len(saved["optimizer_states"][0]["state"]) == len(got)

    assert_a_longer_resume_follows_the_config(resumed, tmp_path)

    # Another rank on resume: one line naming an adapter, before the run folder takes the
    # config (it was a size-mismatch line per tensor inside fit, and the run's saved configs
    # kept rank 4, so that a later plain --resume failed the same way).
    configs = sorted((resumed / "configs").iterdir())
    wider = LORA.replace("rank: 2, alpha", "rank: 4, alpha")
    result = run_main_here(
        ["-r", resumed, f"model.params.lora={wider}", "lightning.trainer.max_steps=99", "-t"],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if "error" in x]
    assert "lora_" in line and " as 2x" in line and "this config builds 4x" in line, line
    assert sorted((resumed / "configs").iterdir()) == configs
