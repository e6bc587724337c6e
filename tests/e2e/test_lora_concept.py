"""scripts/lora_concept.py --base-quantization: the same LoRA on the demo base stored in each
format, each row compared with the full-precision one, and each quantized run truly trained on
a base in that format (read back from its checkpoint against the formats' own definitions)."""

import re

import pytest
import torch
from lora_concept import CONFIG, comparison_table, main, quantizations

from ldm import checkpoint
from ldm.block_swap import blocks_of
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

# QLoRA's NormalFloat4 levels (Dettmers et al. 2023, arXiv:2305.14314, appendix E).
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)


def test_each_format_is_compared_with_the_full_precision_row():
    none = {"concept": 75, "drift": 0, "colour": 100, "shape": 90, "both": 90, "train_s": 100}
    nf4 = {"concept": 60, "drift": 25, "colour": 95, "shape": 90, "both": 81, "train_s": 150}
    lines = comparison_table({"none": none, "nf4": nf4})
    assert lines[2] == "| none | 75 % | 0 % | 100 % | 90 % | 90 % | 100.0 s |"
    # ratios by hand: 60/75, 25/0 (no ratio), 95/100, 90/90, 81/90, 150/100
    assert lines[3] == (
        "| nf4 | 60 % (0.80x) | 25 % (-) | 95 % (0.95x) | 90 % (1.00x) | 81 % (0.90x) "
        "| 150.0 s (1.50x) |"
    )


def test_the_full_precision_run_is_always_made_first_and_a_wrong_format_is_refused(capsys):
    assert quantizations("fp8,int8,fp8") == ["none", "fp8", "int8"]
    assert quantizations("nf4, none") == ["none", "nf4"]
    with pytest.raises(SystemExit) as stop:
        main(["--base-ckpt", CONFIG.as_posix(), "--base-quantization", "int4"])
    assert stop.value.code == 2
    assert "'int4' is not a base format" in capsys.readouterr().err


def trained_base(path):
    """A demo-shaped base, every weight moved off its init, as an original-layout checkpoint
    without EMA weights (the script then trains on the raw ones)."""
    torch.manual_seed(0)
    model = instantiate_from_config(to_container(merge_configs([CONFIG]))["model"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": model.state_dict()}, path)


def lora_model(config_files, ckpt):
    """A run's model (adapters included) with `ckpt` loaded: a base file or a run's checkpoint."""
    model = instantiate_from_config(to_container(merge_configs(config_files))["model"])
    checkpoint.load_weights(model, ckpt, ema=False)
    return model


def check_format(kind, trained, base):
    """`trained` (a quantized run's base, as its checkpoint holds it) is `base` stored in
    `kind`, read against each format's definition; `none` is the base unchanged."""
    if kind == "none":
        assert torch.equal(trained, base)
        return
    assert not torch.equal(trained, base)  # quantized, yet the same base:
    assert (trained - base).norm() < 0.15 * base.norm()
    if kind == "int8":  # LLM.int8: each row on 127 levels of its absmax (arXiv:2208.07339)
        levels = trained * 127 / trained.abs().amax(dim=1, keepdim=True)
        torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)
    elif kind == "fp8":  # float8_e4m3fn values times one scale per row, absmax -> 448
        values = trained * 448 / trained.abs().amax(dim=1, keepdim=True)
        as_fp8 = values.to(torch.float8_e4m3fn).float()
        torch.testing.assert_close(values, as_fp8, rtol=1e-5, atol=1e-6)
    elif kind == "nf4":  # blocks of 64 on NF4's 16 levels of the block's absmax
        blocks = trained.flatten().view(-1, 64)
        levels = blocks / blocks.abs().amax(dim=1, keepdim=True)
        nearest = (levels[..., None] - NF4_LEVELS).abs().min(dim=-1).values
        assert nearest.max() < 1e-5, nearest.max()


@pytest.mark.slow  # four main.py runs (one per base format) and their scoring: ~60 s of CPU
def test_the_lora_trains_on_the_base_in_each_format_and_is_compared(tmp_path, capsys, monkeypatch):
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = tmp_path / "base.ckpt"
    trained_base(base)
    out = tmp_path / "out"
    main(
        ["--base-ckpt", str(base), "--out", str(out), "--base-quantization", "int8,nf4,fp8"]
        + ["--steps", "2", "--n", "2", "--instances", "2", "--jobs", "2", "--sample-steps", "2"]
    )
    printed = capsys.readouterr().out
    table = printed[printed.index("| base |") :].strip().splitlines()
    rows = {line.split(" | ")[0][2:]: line for line in table[2:]}
    assert list(rows) == ["none", "int8", "nf4", "fp8"]
    seconds = {k: float(re.search(r"\| ([\d.]+) s", line)[1]) for k, line in rows.items()}
    for kind in ("int8", "nf4", "fp8"):  # the time ratio is the one to the none row
        ratio = float(re.search(r"s \(([\d.]+)x\) \|$", rows[kind])[1])
        exact = seconds[kind] / seconds["none"]  # of the printed (rounded) times
        assert abs(ratio - exact) <= 0.005 + 0.05 * (exact + 1) / seconds["none"], rows[kind]

    runs = {p.name.split("_lora-")[1]: p for p in (out / "logs").iterdir()}
    assert sorted(runs) == ["fp8", "int8", "nf4", "none"]
    configs = sorted(runs["none"].glob("configs/*.yaml"))
    original = dict(lora_model(configs, base).model.named_modules())
    for kind, run in runs.items():
        model = lora_model(sorted(run.glob("configs/*.yaml")), run / "checkpoints" / "last.ckpt")
        # what base_quantization stores quantized: the layers in the blocks the backbone names
        # (docs/quantized.md; the UNet's input blocks but conv_in, middle and output blocks)
        in_blocks = {id(m) for block in blocks_of(model.model) for m in block.modules()}
        adapted = {
            n: m
            for n, m in model.model.named_modules()
            if hasattr(m, "base_layer") and id(m) in in_blocks
        }
        assert len(adapted) >= 32  # the attention projections of the 5 transformer blocks
        for name, layer in adapted.items():
            check_format(kind, layer.base_layer.weight, original[name].base_layer.weight)
            for adapter in (layer.lora_A["default"], layer.lora_B["default"]):
                assert adapter.weight.dtype == torch.float32  # the adapters stay fp32
            assert layer.lora_B["default"].weight.abs().sum() > 0  # and they trained
