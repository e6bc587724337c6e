"""Each text encoder says what LoRA may target (`lora_targets()`): exactly the adapted kinds of
layer (attention and MLP: kohya's `lora_te_` modules) that the encoder's output reads.

The independent statement is the gradient: a layer the output reads gets a nonzero gradient from
it, a layer after the read-out gets none (and an adapter there would be a parameter without a
gradient, which DDP refuses). So the targets must equal the adaptable layers with a gradient.
"""

import pytest
import torch
from torch import nn

from ldm.text_encoder import FrozenCLIPEmbedder, FrozenOpenCLIPEmbedder
from ldm.text_encoder_xl import FrozenOpenCLIPEmbedder2

TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
TINY_CLIP["num_attention_heads"] = 4
TINY_OPENCLIP = {"width": 32, "layers": 3, "heads": 4, "embed_dim": 16}
PROMPTS = ["a red circle on a blue background", "two squares"]


def reached_by_gradient(encoder: nn.Module, module: nn.Module) -> tuple[set, set]:
    """(Linear layers, other weight matrices) of `module` whose weights get a nonzero gradient
    from a random projection of `encoder`'s outputs (a plain sum would be blind after a
    LayerNorm: its outputs sum to a constant)."""
    encoder.requires_grad_(True)
    outputs = encoder(PROMPTS)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(0)
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs)
    loss.backward()

    def reached(param):
        return param.grad is not None and param.grad.abs().sum() > 0

    linears = {
        n for n, m in module.named_modules() if isinstance(m, nn.Linear) and reached(m.weight)
    }
    matrices = {
        n
        for n, p in module.named_parameters()
        if n.endswith("in_proj_weight") and reached(p)  # OpenCLIP's fused q/k/v
    }
    return linears, matrices


@pytest.mark.parametrize(
    "layer, layer_idx, read",
    [("last", None, 3), ("pooled", None, 3), ("hidden", -2, 2), ("hidden", 1, 1)],
)
def test_clip_targets_are_the_attention_and_mlp_layers_the_output_reads(layer, layer_idx, read):
    torch.manual_seed(0)
    encoder = FrozenCLIPEmbedder(config=TINY_CLIP, layer=layer, layer_idx=layer_idx)
    [target] = encoder.lora_targets()
    linears, _ = reached_by_gradient(encoder, target.module)
    assert set(target.layers) == linears
    assert len(target.layers) == 6 * read  # q, k, v, out, fc1, fc2 of each layer read
    assert target.parameters == [] and target.plain_only is None and target.tower is encoder


@pytest.mark.parametrize(
    "make, read",
    [
        (lambda: FrozenOpenCLIPEmbedder(**TINY_OPENCLIP, layer="penultimate"), 2),
        (lambda: FrozenOpenCLIPEmbedder(**TINY_OPENCLIP, layer="last"), 3),
        # SDXL's bigG: penultimate features, but the pooled output reads the last block too
        (
            lambda: FrozenOpenCLIPEmbedder2(
                "ViT-H-14",
                **TINY_OPENCLIP,
                layer="penultimate",
                always_return_pooled=True,
                legacy=False,
            ),
            3,
        ),
    ],
)
def test_openclip_targets_are_the_layers_and_fused_qkv_the_output_reads(make, read):
    torch.manual_seed(0)
    encoder = make()
    [target] = encoder.lora_targets()
    linears, fused = reached_by_gradient(encoder, target.module)
    assert set(target.layers) == linears
    assert set(target.parameters) == fused
    assert (len(target.layers), len(target.parameters)) == (3 * read, read)
    assert target.plain_only  # a fused weight takes plain LoRA only (peft)
