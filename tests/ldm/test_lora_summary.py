"""A LoRA run says what got adapters: the layers, the rank and the trainable parameters."""

import logging
import re

from torch import nn

from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

# The attention projections of the SD UNet's transformers (CompVis names), as kohya's "attn".
ATTENTION = re.compile(r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$")


def test_the_summary_counts_the_adapted_layers_and_their_parameters(tiny_config, caplog):
    plain = instantiate_from_config(to_container(merge_configs([tiny_config]))["model"])
    layers = [
        m
        for n, m in plain.model.named_modules()
        if ATTENTION.search(n) and isinstance(m, nn.Linear)
    ]
    rank = 2
    trainable = sum(
        rank * (m.in_features + m.out_features) for m in layers
    )  # A: r x in, B: out x r
    total = sum(p.numel() for p in plain.parameters()) + trainable
    lora = "model.params.lora={rank: 2, targets: [attn]}"
    with caplog.at_level(logging.INFO, logger="ldm.lora"):
        instantiate_from_config(to_container(merge_configs([tiny_config], [lora]))["model"])
    assert [r.getMessage() for r in caplog.records if r.name == "ldm.lora"] == [
        f"LoRA: adapters on {len(layers)} UNet layers (attn), rank 2, alpha 2; {trainable:,} "
        f"trainable parameters ({100 * trainable / total:.2f} % of {total:,})"
    ]
