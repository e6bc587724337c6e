"""Block swap (ldm.block_swap) on the CPU: a block's weights are present only while it is loaded
(empty otherwise, checked from the layers' own forward), never more than the configured number
of blocks at once, and the outputs and gradients are bitwise those of the model without swap."""

import copy

import pytest
import torch
from torch import nn

from ldm.block_swap import blocks_of, swap_blocks


def tiny_dit():
    from ldm.dit import DiT

    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=5, num_heads=2)
    with torch.no_grad():
        for p in model.parameters():  # past adaLN-Zero: every block does something
            p.add_(0.05 * torch.randn_like(p))
    return model


def with_adapters(model):
    """LoRA on each block's attention (trainable, never swapped), the rest frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, target_modules=["qkv"], init_lora_weights=False), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def step(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=generator, requires_grad=True)
    out = model(x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def watch_residency(model, seen: list):
    """Before every Linear runs: how many blocks have their frozen weights present (non-empty),
    read from the parameters themselves."""
    blocks = blocks_of(model)

    def count(*_):
        seen.append(
            sum(
                all(p.numel() > 0 for p in b.parameters() if not p.requires_grad)
                for b in blocks[:SWAPPED]
            )
        )

    for block in blocks:
        for module in block.modules():
            if type(module) is nn.Linear:
                module.register_forward_pre_hook(count)


SWAPPED = 4  # of the 5 blocks


@pytest.mark.parametrize("resident", [1, 2])
def test_swapped_blocks_give_bitwise_the_same_outputs_and_gradients(resident):
    plain = with_adapters(tiny_dit())
    swapped = copy.deepcopy(plain)
    expected = step(plain)
    swap_blocks(swapped, SWAPPED, torch.device("cpu"), resident=resident)
    seen = []
    watch_residency(swapped, seen)
    for _ in range(2):  # the second step starts from the state the first left
        got = step(swapped)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[2].keys() == expected[2].keys() and len(got[2]) == 2 * 5  # A, B of each block
        assert all(torch.equal(got[2][n], expected[2][n]) for n in expected[2])
        swapped.zero_grad()
    assert max(seen) <= resident  # never more than the configured blocks at once
    assert min(seen) >= 1  # and the block computing is always there
    # the backward ran the blocks again (recompute): more layer calls than one forward
    assert len(seen) > 2 * 2 * 5 * SWAPPED


def test_a_block_not_loaded_cannot_compute():
    model = tiny_dit().requires_grad_(False)
    swap = swap_blocks(model, 2, torch.device("cpu"))
    block = blocks_of(model)[0]
    assert all(p.numel() == 0 for p in block.parameters())  # in host RAM only
    with pytest.raises(RuntimeError):
        nn.Module.__call__(block.attn.qkv, torch.randn(1, 16, 32))
    assert len(swap.loaded) == 0


def test_the_state_dict_is_the_full_weights_whatever_is_loaded():
    model = tiny_dit().requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swap_blocks(model, 3, torch.device("cpu"))
    state = model.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k], before[k]) for k in before)
    model.load_state_dict(before)  # loading fills the host copies


def test_an_nf4_base_swaps_and_computes_the_same():
    pytest.importorskip("bitsandbytes")
    from ldm.quantize import quantize_frozen

    plain = tiny_dit().requires_grad_(False).eval()
    for block in blocks_of(plain):
        quantize_frozen(block, "nf4", torch.float32)
    swapped = copy.deepcopy(plain)
    swap_blocks(swapped, SWAPPED, torch.device("cpu"))
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    args = (x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    with torch.no_grad():
        assert torch.equal(swapped(*args), plain(*args))


def test_int8_with_block_swap_is_refused_by_name():
    from ldm.lora import parse_settings

    with pytest.raises(ValueError, match=r"^model.params.lora.blocks_to_swap: not with an int8"):
        parse_settings({"base_quantization": "int8", "blocks_to_swap": 2})
