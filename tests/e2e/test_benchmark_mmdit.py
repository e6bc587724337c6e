"""scripts/benchmark_mmdit.py (the `--only mmdit` row) at a tiny size: our MMDiT and diffusers'
SD3Transformer2DModel hold the same weights (diffusers computes our output), and the section
measures both sides' steps and peak memory, each side's memory in its own process."""

import argparse

import pytest
import torch

pytest.importorskip("diffusers")
import benchmark_mmdit  # noqa: E402
from bench_backbone import output_gap  # noqa: E402

TINY = dict(
    depth=2,
    hidden_size=64,
    num_heads=2,
    in_channels=16,
    context_dim=4096,
    pooled_dim=2048,
    pos_embed_max_size=32,  # the section's 64x64 latent is 32x32 patches
    qk_norm=True,
    dual_attention_layers=[0],
)


def test_both_sides_compute_the_same_function():
    ours, theirs = benchmark_mmdit.build_models(torch.device("cpu"), TINY)
    batch = benchmark_mmdit.inputs(torch.device("cpu"), TINY)
    with torch.no_grad():
        out = benchmark_mmdit.forward(ours, batch)
        ref = benchmark_mmdit.forward(theirs, batch)
    assert out.shape == batch[0].shape
    assert out.abs().mean() > 0.05  # the randomised blocks are not idle (adaLN-Zero)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert "max |diff|" in output_gap(benchmark_mmdit, ours, theirs, batch)


@pytest.mark.slow  # two child processes (one per side) import torch and diffusers: ~25 s
def test_section_prints_speed_and_memory_ratios(capsys):
    args = argparse.Namespace(steps=1, warmup=0)
    rows = benchmark_mmdit.mmdit_section(args, torch.device("cpu"), TINY)
    header, rule, *sides = rows
    assert header.count(" |") == rule.count("|---") == 7
    assert [row.split(" | ")[0] for row in sides] == ["| diffusers", "| ours"]
    diffusers, ours = ([cell.strip() for cell in row.strip("|").split("|")] for row in sides)
    assert diffusers[3] == diffusers[5] == diffusers[6] == "1.00x"  # the reference side
    assert float(ours[3].rstrip("x")) > 0 and ours[4].endswith("MiB")
    assert float(ours[4].split()[0]) > 0
    assert "activations kept for the backward: ours" in capsys.readouterr().out


def test_benchmark_runs_the_row_by_name():
    import benchmark

    assert "mmdit" in benchmark.SECTIONS  # `--only mmdit`
