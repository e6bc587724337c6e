"""Block swap (ldm.block_swap) on the CPU: a block's weights are present only while it is loaded
(empty otherwise, checked from the layers' own forward), never more than the configured number
of blocks at once, and the outputs and gradients are bitwise those of the model without swap."""

import copy

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from ldm.block_swap import BlockSwap, blocks_of, swap_blocks


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


def test_a_module_wide_dtype_change_after_the_swap_reaches_the_swapped_weights():
    """Lightning's true precision (`bf16-true`) converts the whole model after the `setup`
    hook, where the blocks were swapped: the swapped model then computes, and saves, what the
    same model converted without swap does - also when the conversion finds blocks loaded
    (here after a first pass in fp32)."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    precision = HalfPrecision("bf16-true")
    plain = tiny_dit().requires_grad_(False)
    swapped = copy.deepcopy(plain)
    swap_blocks(swapped, SWAPPED, torch.device("cpu"))
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    args = (x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    with torch.no_grad():
        assert torch.equal(swapped(*args), plain(*args))  # leaves the last blocks loaded
    plain, swapped = precision.convert_module(plain), precision.convert_module(swapped)
    args = (x.to(torch.bfloat16), *args[1:])
    with torch.no_grad():
        for _ in range(2):  # blocks loaded, evicted, loaded again
            assert torch.equal(swapped(*args), plain(*args))
    expected, state = plain.state_dict(), swapped.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in expected.items())


def test_unswapping_after_a_dtype_change_gives_the_blocks_the_converted_weights():
    """A fit under `bf16-true` converts the model after the swap (the test above): at the
    fit's end the blocks, loaded or not, hold what the model converted without swap holds."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    from ldm.block_swap import unswap_blocks

    precision = HalfPrecision("bf16-true")
    plain = tiny_dit().requires_grad_(False)
    swapped = copy.deepcopy(plain)
    swap = swap_blocks(swapped, SWAPPED, torch.device("cpu"))
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    args = (x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    with torch.no_grad():
        swapped(*args)  # the last blocks loaded, the first ones not
    assert 0 < len(swap.loaded) < SWAPPED
    plain, swapped = precision.convert_module(plain), precision.convert_module(swapped)
    args = (x.to(torch.bfloat16), *args[1:])
    assert unswap_blocks(swapped) and not unswap_blocks(swapped)  # once
    expected, state = plain.state_dict(), swapped.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in expected.items())
    with torch.no_grad():
        assert torch.equal(swapped(*args), plain(*args))


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


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
def test_an_nf4_layer_computes_as_bitsandbytes_own_forward(compute_dtype, autocast):
    """Our nf4 layers run through their own autograd Function (whose saved bits checkpointing
    can drop, for block swap); output and input gradient are bitwise bitsandbytes' own
    `Linear4bit.forward`'s, on the same layer."""
    bnb = pytest.importorskip("bitsandbytes")
    from ldm.quantize import quantized_layer

    torch.manual_seed(0)
    layer = quantized_layer(nn.Linear(128, 64).requires_grad_(False), "nf4", compute_dtype)
    x = torch.randn(3, 5, 128, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        ours, theirs = layer(x), bnb.nn.Linear4bit.forward(layer, x)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    (mine,) = torch.autograd.grad(ours.square().sum(), x)
    (reference,) = torch.autograd.grad(theirs.square().sum(), x)
    assert torch.equal(mine, reference)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_quantized_base_swaps_with_bitwise_the_same_gradients(kind):
    """fp8 and int8 layers save their stored bytes and scales for the backward (ldm.quantize):
    under block swap's recompute those are the reloaded block's, and the adapters' gradients
    stay the same."""
    if kind == "int8":
        pytest.importorskip("bitsandbytes")
    from ldm.lora import quantize_blocks

    plain = with_adapters(tiny_dit())
    assert quantize_blocks(plain, kind, torch.float32) > 0
    swapped = copy.deepcopy(plain)
    swap_blocks(swapped, SWAPPED, torch.device("cpu"))
    expected, got = step(plain), step(swapped)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2].keys() == expected[2].keys() and len(got[2]) == 2 * 5
    assert all(torch.equal(got[2][n], expected[2][n]) for n in expected[2])


@pytest.mark.parametrize("kind", ["fp8", "int8", "nf4"])
def test_a_checkpoint_of_a_swapped_quantized_base_is_the_one_without_swap(kind):
    """A LoRA run's checkpoint holds the quantized base's weights dequantized (ldm.lora.
    checkpoints, `ldm.quantize.dequantize` of each layer): under block swap, for the blocks off
    the device as for those on it, they are what they are without swap."""
    if kind in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    from ldm.diffusion import DiffusionWrapper
    from ldm.lora import quantize_blocks
    from ldm.lora.checkpoints import save_layout

    plain = nn.Module()
    plain.model = DiffusionWrapper(with_adapters(tiny_dit()))
    assert quantize_blocks(plain.model, kind, torch.float32) > 0
    swapped = copy.deepcopy(plain)
    swap = swap_blocks(swapped.model, SWAPPED, torch.device("cpu"))
    step(swapped.model.diffusion_model)  # some blocks loaded, the others not
    assert 0 < len(swap.loaded) < SWAPPED
    files = []
    for model in (plain, swapped):
        ckpt = {"state_dict": model.state_dict()}
        save_layout(model, ckpt)
        files.append(ckpt["state_dict"])
    expected, got = files
    assert got.keys() == expected.keys()
    frozen = [k for k in expected if k.endswith((".weight", ".bias")) and "lora_" not in k]
    assert len(frozen) > 5 * 4 * 2  # the blocks' quantized layers' weights and biases among them
    assert [k for k in frozen if not torch.equal(got[k], expected[k])] == []


def test_int8_with_block_swap_is_accepted():
    from ldm.lora import parse_settings

    for swap in (2, "auto"):
        settings = parse_settings({"base_quantization": "int8", "blocks_to_swap": swap})
        assert (settings.base_quantization, settings.blocks_to_swap) == ("int8", swap)


def quantized_dit(kind: str, seed=0):
    """The tiny DiT with adapters, its blocks' frozen layers stored as `kind`."""
    if kind == "int8":
        pytest.importorskip("bitsandbytes")
    from ldm.lora import quantize_blocks

    model = tiny_dit()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # seed 0: tiny_dit's weights; others: weights of their own
            p.add_(0.05 * seed * torch.randn(p.shape, generator=generator))
    model = with_adapters(model)
    assert quantize_blocks(model, kind, torch.float32) > 0
    return model


def test_an_evicted_int8_layer_points_at_nothing_but_placeholders_and_its_host_copies():
    """bitsandbytes hangs references to the int8 rows and scales on the layer's state and on
    its parameter (CB, SCB): after a step, a layer whose block left the device keeps no tensor
    there through any of them - only the empty placeholders and, in host RAM, the copies."""
    from ldm.block_swap import host_copy

    model = quantized_dit("int8")
    swap = swap_blocks(model, SWAPPED, torch.device("cpu"))
    step(model)
    gone = [index for index in range(SWAPPED) if index not in swap.loaded]
    layers = [
        m for i in gone for m in blocks_of(model)[i].modules() if type(m).__name__ == "Linear8bitLt"
    ]
    assert gone and layers
    for layer in layers:
        hosts = [host_copy(layer, "weight"), host_copy(layer, "row_scales")]
        assert all(h is not None and h.numel() > 0 for h in hosts)
        reachable = [layer.weight.data, layer.row_scales]
        reachable += [layer.state.CB, layer.state.SCB, layer.weight.CB, layer.weight.SCB]
        for tensor in (t for t in reachable if t is not None):
            assert tensor.numel() == 0 or any(
                tensor.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() for h in hosts
            )


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_swapped_quantized_base_saves_and_loads_the_state_dict_without_swap(kind):
    """The state dict of a quantized layer - bitsandbytes' for int8 (`weight` int8, `SCB` fp32,
    `weight_format`), fp8's (`weight` bytes, `weight_scale` fp32), the scales of both held as
    int32 bits in the module - from a swapped model, blocks loaded or not, is the one without
    swap; loading another model's fills the host copies (weights and scales) and the blocks on
    the device: the swapped model then computes as it."""
    plain, other = quantized_dit(kind, seed=0), quantized_dit(kind, seed=1)
    swapped = copy.deepcopy(plain)
    swap = swap_blocks(swapped, SWAPPED, torch.device("cpu"))
    step(swapped)
    assert 0 < len(swap.loaded) < SWAPPED
    expected, state = plain.state_dict(), swapped.state_dict()
    scales = ".SCB" if kind == "int8" else ".weight_scale"
    assert state.keys() == expected.keys() and any(k.endswith(scales) for k in state)
    assert [k for k in expected if not torch.equal(state[k], expected[k])] == []
    swapped.load_state_dict(other.state_dict())
    got, want = step(swapped), step(other)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- the order of copies, waits and evictions (what keeps the device's streams safe) -------------


class Recorded(BlockSwap):
    """The real BlockSwap, its copies, the compute stream's waits for them and its evictions
    written down in the order they happen."""

    def __init__(self, *args, **kwargs):
        self.log = []
        super().__init__(*args, **kwargs)

    def _fetch(self, index):
        new = index not in self.loaded and 0 <= index < len(self.blocks)
        super()._fetch(index)
        if new:
            self.log.append(("copy", index))

    def _wait_for_copy(self, index):
        if index in self.copying:
            self.log.append(("wait", index))
        super()._wait_for_copy(index)

    def _evict(self, index):
        super()._evict(index)
        self.log.append(("evict", index))


def test_each_block_gives_up_its_own_tensors_before_the_next_one_is_copied():
    """On an accelerator the host copies are new (pinned) memory: made for all blocks before
    any block let go of its own tensors, host memory would peak at twice the swapped weights.
    When the last block is copied, only it still holds its own."""

    class Watched(BlockSwap):
        def _to_host(self, tensor, pin):
            holding = [any(p.numel() > 0 for p in b.parameters()) for b in self.blocks]
            self.holding.append(sum(holding))
            return super()._to_host(tensor, pin)

    Watched.holding = []
    blocks = blocks_of(tiny_dit().requires_grad_(False))[:SWAPPED]
    Watched(blocks, torch.device("cpu"))
    assert Watched.holding[0] == SWAPPED and Watched.holding[-1] == 1


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_a_block_leaves_the_device_only_after_the_compute_stream_waited_for_its_copy(resident):
    """CUDA's caching allocator reuses memory freed on the compute stream (where the blocks'
    tensors are allocated) for that stream's next tensors at once, knowing nothing of the side
    stream (torch docs, `Tensor.record_stream`): a block prefetched, then evicted before it ran,
    must first have the compute stream wait for its copy. Loads in any order: a forward cut
    short (an error in block 2) and a new one; training steps whose backward recomputes blocks
    4 and 3 only (blocks 0-2 hold no adapters and get no gradient: its prefetch of block 2 is
    never used); then a shuffled order."""
    swap = Recorded(blocks_of(tiny_dit())[:5], torch.device("cpu"), resident)
    order = [0, 1, 2, 0, 1, 2, 3, 4, 4, 3, 2, 1, 0]
    order += [0, 1, 2, 3, 4, 4, 3] * 3
    order += torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist() * 3
    for index in order:
        swap.load(index)
        assert index in swap.loaded and index not in swap.copying  # ready for the compute
    copying = set()
    for what, index in swap.log:
        if what == "copy":
            copying.add(index)
        elif what == "wait":
            copying.discard(index)
        else:
            assert index not in copying, f"block {index} evicted with its copy in flight"
    assert ("evict", 2) in swap.log[swap.log.index(("copy", 2)) :]  # the cut-short case ran


def test_a_new_pass_has_its_second_block_on_the_way_while_the_first_computes():
    """The next block is copied in while one computes - also for block 0 of a pass that follows
    another (sampling: a forward per step), where the last block ran just before."""
    model = tiny_dit().requires_grad_(False).eval()
    blocks = blocks_of(model)
    swap_blocks(model, SWAPPED, torch.device("cpu"), resident=2)
    present = []
    first_layer = next(m for m in blocks[0].modules() if type(m) is nn.Linear)
    first_layer.register_forward_pre_hook(
        lambda *_: present.append(all(p.numel() > 0 for p in blocks[1].parameters()))
    )
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        for _ in range(3):
            model(x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    assert present == [True, True, True]


@pytest.mark.parametrize("kind", ["none", "fp8", "int8", "nf4"])
def test_a_block_off_the_device_holds_no_memory_there_while_the_graph_waits(kind):
    """Block swap's point: once a block has left the device its weights' memory there is free,
    also between the forward and the backward (when the autograd graph of the whole step is
    alive: the swapped blocks run under activation checkpointing, which saves nothing of
    them). Any layer keeping its weight in the graph outside autograd's saved tensors (or a
    reference of its own: bitsandbytes' CB / SCB) would keep every swapped block on the
    device; any keeping its input there (bitsandbytes' matmuls keep it on their autograd
    context) would keep every swapped block's activations until the backward."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if kind in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    from ldm.lora import quantize_blocks

    model = with_adapters(tiny_dit())
    if kind != "none":
        assert quantize_blocks(model, kind, torch.float32) > 0
    swap = swap_blocks(model, SWAPPED, torch.device("cpu"), resident=2)
    blocks = blocks_of(model)
    storages = {index: [] for index in range(SWAPPED)}  # what each block computed with
    inputs = {index: [] for index in range(SWAPPED)}  # its frozen layers' inputs

    def record(index):
        def hook(module, args):
            for tensor in [*blocks[index].parameters(), *blocks[index].buffers()]:
                if not tensor.requires_grad:
                    storages[index].append(StorageWeakRef(tensor.untyped_storage()))
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and not weight.requires_grad:
                inputs[index].append(StorageWeakRef(args[0].untyped_storage()))

        return hook

    for index in range(SWAPPED):
        for module in blocks[index].modules():
            if not list(module.children()):  # every leaf layer, as it runs
                module.register_forward_pre_hook(record(index))
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    out = model(x, torch.tensor([3, 700]), {"y": torch.tensor([0, 1])})
    gone = [index for index in range(SWAPPED) if index not in swap.loaded]
    assert gone and all(storages[index] for index in gone)
    held = [index for index in gone if not all(s.expired() for s in storages[index])]
    assert held == [], f"blocks {held} still hold their weights, off the device"
    assert all(inputs[index] for index in range(SWAPPED))
    kept = [index for index in range(SWAPPED) if not all(s.expired() for s in inputs[index])]
    assert kept == [], f"blocks {kept} still hold their layers' inputs until the backward"
    out.square().mean().backward()  # and the backward still runs (reloading them)


# --- which blocks: each backbone names them (blocks_in_order), in the order they run ---------


def named_backbones():
    """Every backbone family at toy size, with one call of its forward."""
    from ldm.dit import DiT
    from ldm.dit_text import TextDiT
    from ldm.flux import Flux
    from ldm.mmdit import MMDiT
    from ldm.unet import UNetModel

    torch.manual_seed(0)
    x, t = torch.randn(1, 4, 8, 8), torch.tensor([500])
    text = {"crossattn": torch.randn(1, 3, 24), "vector": torch.randn(1, 16)}
    unet = UNetModel(
        image_size=8, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[2],
        num_res_blocks=1, channel_mult=[1, 2], num_heads=2, use_spatial_transformer=True,
        transformer_depth=1, context_dim=24,
    )  # fmt: skip
    return {
        "unet": (unet, lambda m: m(x, t, context=text["crossattn"])),
        "dit": (
            DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2),
            lambda m: m(x, t, {"y": torch.tensor([1])}),
        ),
        "text-dit": (
            TextDiT(24, input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2,
                    num_heads=2),
            lambda m: m(x, t, text),
        ),
        "mmdit": (
            MMDiT(depth=2, hidden_size=64, num_heads=2, in_channels=4, context_dim=24,
                  pooled_dim=16, pos_embed_max_size=8, sample_size=8),
            lambda m: m(x, t.float(), text),
        ),
        # Flux with one block of each kind (configs/flux/tiny.yaml's depth)
        "flux": (
            Flux(depth=1, depth_single_blocks=1, hidden_size=32, num_heads=2, axes_dim=(4, 6, 6),
                 in_channels=4, context_dim=24, pooled_dim=16),
            lambda m: m(x, t.float(), {**text, "guidance": torch.tensor([3.5])}),
        ),
    }  # fmt: skip


# The layers of each backbone outside its blocks, written out from the architectures (the
# papers' figures / the original code): they stay in full precision, small and read for their
# dtype - the input embedders and the output layer.
NOT_IN_BLOCKS = {
    "unet": [
        "time_embed.0", "time_embed.2",  # timestep MLP
        "input_blocks.0.0",  # conv_in: the latent's embedding
        "out.2",  # conv_out
    ],
    "dit": [
        "x_embedder.proj", "t_embedder.mlp.0", "t_embedder.mlp.2",  # patch / timestep embedders
        "final_layer.adaLN_modulation.1", "final_layer.linear",
    ],
    "text-dit": [
        "x_embedder.proj", "t_embedder.mlp.0", "t_embedder.mlp.2",
        "y_embedder.fc1", "y_embedder.fc2",  # caption projection
        "t_block.1",  # adaLN-single: the one modulation all blocks share
        "final_layer.linear",
    ],
    "mmdit": [
        "x_embedder.proj", "t_embedder.mlp.0", "t_embedder.mlp.2", "y_embedder.mlp.0",
        "y_embedder.mlp.2", "context_embedder",
        "final_layer.adaLN_modulation.1", "final_layer.linear",
    ],
    "flux": [
        "img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer",
        "vector_in.out_layer", "guidance_in.in_layer", "guidance_in.out_layer",
        "final_layer.adaLN_modulation.1", "final_layer.linear",
    ],
}  # fmt: skip


@pytest.mark.parametrize("family", list(NOT_IN_BLOCKS))
def test_fp8_quantizes_every_layer_but_the_embedders_and_the_output(family):
    from ldm.lora import quantize_blocks

    backbone, _ = named_backbones()[family]
    backbone.requires_grad_(False)
    layers = [n for n, m in backbone.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]
    assert set(NOT_IN_BLOCKS[family]) <= set(layers)
    replaced = quantize_blocks(backbone, "fp8", torch.float32)
    left = [n for n, m in backbone.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]
    assert sorted(left) == sorted(NOT_IN_BLOCKS[family])
    assert replaced == len(layers) - len(left)


def test_tiny_flux_with_one_block_of_each_kind_gets_both_quantized():
    """configs/flux/tiny.yaml's depth (1 + 1): both blocks' layers in fp8, none left out."""
    from ldm.lora import quantize_blocks
    from ldm.quantize import Fp8Linear

    flux, _ = named_backbones()["flux"]
    flux.requires_grad_(False)
    quantize_blocks(flux, "fp8", torch.float32)
    for block in (flux.double_blocks[0], flux.single_blocks[0]):
        kinds = {type(m) for m in block.modules() if not list(m.children())}
        assert Fp8Linear in kinds and nn.Linear not in kinds


def test_the_unet_middle_block_is_quantized():
    from ldm.lora import quantize_blocks
    from ldm.quantize import Fp8Conv2d, Fp8Linear

    unet, _ = named_backbones()["unet"]
    unet.requires_grad_(False)
    quantize_blocks(unet, "fp8", torch.float32)
    kinds = [type(m) for m in unet.middle_block.modules() if not list(m.children())]
    # two ResBlocks' two 3x3 convolutions, the transformer's 1x1 proj_in / proj_out (SD 1.x)
    assert kinds.count(Fp8Conv2d) == 6
    assert Fp8Linear in kinds and nn.Linear not in kinds and nn.Conv2d not in kinds


@pytest.mark.parametrize("family", list(NOT_IN_BLOCKS))
def test_the_blocks_are_named_in_the_order_the_forward_runs_them(family):
    """Block swap prefetches the next block of the list: it must be the next one to run. The
    order the forward calls the top-level children of the backbone's block containers."""
    backbone, run = named_backbones()[family]
    blocks = blocks_of(backbone)
    ran = []
    containers = [m for m in backbone.children() if isinstance(m, nn.ModuleList)]
    candidates = [m for c in containers for m in c]
    candidates += [getattr(backbone, "middle_block", None)] if family == "unet" else []
    for module in candidates:
        module.register_forward_pre_hook(lambda m, _: ran.append(m))
    with torch.no_grad():
        run(backbone)
    expected = [m for m in ran if any(True for _ in m.parameters())]
    if family == "unet":
        expected = expected[1:]  # conv_in, the first input block, is the latent's embedding
    assert [id(b) for b in blocks] == [id(m) for m in expected]


def test_a_backbone_that_does_not_name_its_blocks_is_refused_in_one_line():
    from ldm.diffusion import DiffusionWrapper

    unnamed = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match=r"^model.params.lora: the backbone Sequential does not"):
        blocks_of(DiffusionWrapper(unnamed))


def test_more_blocks_to_swap_than_the_backbone_has_is_refused_when_the_model_is_built():
    """`main.py` without -t (a config check) builds the model: the count is refused there, not
    only when the fit starts swapping."""
    from pathlib import Path

    from lora_helpers import build

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
    with pytest.raises(ValueError, match=r"^model.params.lora.blocks_to_swap: 99 is more than"):
        build(config, "{rank: 2, blocks_to_swap: 99}")


# --- block swap lasts one fit: undone when it ends (normally, on an exception, on Ctrl-C) -------

SWAP_SETTINGS = "{{rank: 2, blocks_to_swap: 3, base_quantization: {kind}}}"


def tiny_lora(kind: str):
    """The tiny SD (configs/tiny/ldm.yaml) with LoRA, its first 3 blocks swapped during fits;
    nonzero lora_B, so that the outputs read the base through every adapted layer."""
    from pathlib import Path

    from lora_helpers import build, randomize_adapters

    settings = SWAP_SETTINGS.format(kind=kind)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "ldm.yaml"
    model = build(config, settings)
    randomize_adapters(model)
    return model


class SeesTheSwap(Callback):
    """Records, at each step, whether the blocks were swapped (empty placeholders present);
    raises `error` after the first step (blocks loaded and prefetched then)."""

    def __init__(self, error: BaseException | None = None):
        self.seen, self.error = [], error

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(hasattr(pl_module.model, "block_swap") and placeholders(pl_module) > 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.error is not None:
            assert pl_module.model.block_swap.loaded  # the state an interrupted step leaves
            raise self.error


def placeholders(model) -> int:
    return sum(t.numel() == 0 for t in [*model.parameters(), *model.buffers()])


def fit(model, steps: int = 1, callback=None):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader
    from trainer_helpers import quiet_trainer

    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 32, 32, generator=generator) * 2 - 1
    data = [{"image": image, "caption": "a red circle"} for image in images]
    callbacks = [callback] if callback is not None else []
    quiet_trainer(max_steps=steps, callbacks=callbacks).fit(model, DataLoader(data, batch_size=2))


def assert_unswapped_as(model, reference):
    """`model` is `reference` (same weights, never swapped) in every way a later user sees:
    no swap object, wrappers, hooks, host copies or placeholders; the same state dict; the
    same outputs (bitwise: the same layers on the same tensors)."""
    from lora_helpers import unet_output

    from ldm.block_swap import HOST_COPIES

    assert "block_swap" not in model.model.__dict__
    assert placeholders(model) == 0
    for block in blocks_of(model.model):
        assert "forward" not in block.__dict__  # the class's own forward, no wrapper
        assert not block._state_dict_hooks and not block._load_state_dict_pre_hooks
        assert not block._load_state_dict_post_hooks
        assert all(HOST_COPIES not in m.__dict__ for m in block.modules())
    expected, got = reference.state_dict(), model.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert torch.equal(unet_output(model), unet_output(reference))


def never_swapped(model):
    """A copy of `model` (before its fit) that fits without block swap."""
    import dataclasses

    plain = copy.deepcopy(model)
    plain.lora_settings = dataclasses.replace(plain.lora_settings, blocks_to_swap=0)
    return plain


def with_trained_adapters(reference, model, kind: str):
    """`reference` (`model` before its fit, never swapped), its base quantized as the fit did
    and the adapters `model` trained copied in."""
    from ldm.lora import quantize_blocks

    if kind != "none":
        quantize_blocks(reference.model, kind, torch.float32)
    trained = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.copy_(trained[name])
    return reference


@pytest.mark.slow  # a Lightning fit of the tiny SD
@pytest.mark.parametrize("kind", ["fp8", "nf4"])
def test_a_fit_that_ends_gives_the_swapped_blocks_back_to_the_model(kind):
    if kind == "nf4":
        pytest.importorskip("bitsandbytes")
    model = tiny_lora(kind)
    reference = never_swapped(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    watch = SeesTheSwap()
    fit(model, callback=watch)
    assert watch.seen == [True]  # the fit did run swapped
    trained = dict(model.named_parameters())
    assert any(not torch.equal(trained[n], p) for n, p in before.items())  # and it trained
    assert_unswapped_as(model, with_trained_adapters(reference, model, kind))


@pytest.mark.slow  # a Lightning fit of the tiny SD
@pytest.mark.parametrize("error", [RuntimeError("a step failed"), KeyboardInterrupt()])
def test_a_fit_stopped_by_an_exception_or_ctrl_c_gives_them_back_too(error):
    import signal

    model = tiny_lora("fp8")
    reference = never_swapped(model)
    watch = SeesTheSwap(error)
    handler = signal.getsignal(signal.SIGINT)
    try:  # Lightning answers Ctrl-C with sys.exit(1), ignoring further Ctrl-C from then on
        with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
            fit(model, callback=watch)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert watch.seen == [True]  # stopped after the first step, swapped
    assert_unswapped_as(model, with_trained_adapters(reference, model, "fp8"))


@pytest.mark.slow  # a Lightning fit of the tiny SD
def test_a_second_fit_swaps_again_and_trains_as_without_swap():
    """Two fits in one process, with block swap and without: the same adapters and the same
    model after each (bitwise: the swapped blocks' recompute gives the same gradients), the
    blocks swapped during both fits."""
    swapped = tiny_lora("none")
    plain = never_swapped(swapped)
    for _ in range(2):
        watch = SeesTheSwap()
        fit(swapped, callback=watch)
        fit(plain)
        assert watch.seen == [True]
        assert_unswapped_as(swapped, plain)
