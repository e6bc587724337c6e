"""Flux LoRA files (ldm.layout.kohya_flux) read by diffusers' own loaders.

Our adapters are peft LoRA layers on ldm.flux.Flux. The kohya file goes through diffusers'
kohya converter (`_convert_kohya_flux_lora_to_diffusers`, what `FluxPipeline.lora_state_dict`
calls) and the diffusers file goes in as it is; each is loaded with `load_lora_adapter` into a
FluxTransformer2DModel holding the same base weights, which must then give our output.
Full size: `FluxPipeline.lora_state_dict` (untouched) reads our rank-1 kohya file of every
adapted layer of Flux.1-dev and gives exactly our diffusers file, every name a module of the
full-size FluxTransformer2DModel with the right shapes. Tiny size: the converter hard-codes the
released widths where it cuts `linear1` (`dims=[3072, 3072, 3072, 12288]`); we run its own source
with the tiny widths there (`tiny_kohya_converter`).
"""

import inspect

import pytest
import torch
from safetensors.torch import save_file

from ldm.flux import Flux, flux1_dev, lora_targets
from ldm.layout import kohya_flux

pytest.importorskip("peft")
conversion = pytest.importorskip("diffusers.loaders.lora_conversion_utils")
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402
from flux_helpers import ALPHA, TINY, diffusers_forward, tiny_pair, with_adapters  # noqa: E402


def tiny_kohya_converter(width: int, mlp: int):
    convert = conversion._convert_kohya_flux_lora_to_diffusers
    source = inspect.getsource(convert)
    released = "dims=[3072, 3072, 3072, 12288]"
    assert source.count(released) == 1, "diffusers' kohya converter changed: revisit"
    namespace = dict(vars(conversion))
    exec(source.replace(released, f"dims=[{width}, {width}, {width}, {mlp}]"), namespace)  # noqa: S102
    return namespace[convert.__name__]


def inputs():
    torch.manual_seed(3)
    x, context, pooled = torch.randn(2, 4, 8, 12), torch.randn(2, 6, 20), torch.randn(2, 12)
    return x, torch.tensor([300.0, 800.0]), context, pooled, torch.tensor([3.5, 2.0])


def compare(ours: Flux, theirs: FluxTransformer2DModel, lora: dict, load=None) -> None:
    """diffusers' output with `lora` loaded (by `load`, else load_lora_adapter) == ours."""
    x, t, context, pooled, guidance = inputs()
    with torch.no_grad():
        base = diffusers_forward(theirs, x, t, context, pooled, guidance)
        if load is None:
            theirs.load_lora_adapter(lora, prefix="transformer", adapter_name="ours")
        else:
            load()
        adapted = diffusers_forward(theirs, x, t, context, pooled, guidance)
        mine = ours(x, t, {"crossattn": context, "vector": pooled, "guidance": guidance})
    assert (adapted - base).abs().mean() > 0.05, "the LoRA changed nothing in diffusers"
    torch.testing.assert_close(
        FluxPipeline._pack_latents(mine, *x.shape), adapted, rtol=1e-4, atol=1e-5
    )
    lora_modules = {n for n, m in theirs.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert len(lora_modules) == len({k.rsplit(".lora_", 1)[0] for k in lora}), "keys dropped"


def test_kohya_file_through_diffusers_converter_gives_our_output():
    ours, theirs = tiny_pair()
    with_adapters(ours)
    state = kohya_flux.to_kohya(kohya_flux.peft_adapters(ours))
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in state
    assert "lora_unet_single_blocks_1_linear1.alpha" in state
    width = TINY["hidden_size"]
    converted = tiny_kohya_converter(width, 4 * width)(dict(state))
    compare(ours, theirs, converted)


def test_diffusers_file_loads_with_flux_pipeline_with_our_output(tmp_path):
    """The file through FluxPipeline.load_lora_weights (the pipeline holds only the
    transformer: the text encoders get no LoRA)."""
    ours, theirs = tiny_pair()
    with_adapters(ours)
    state = kohya_flux.to_diffusers(kohya_flux.peft_adapters(ours))
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in state
    assert "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight" in state
    path = tmp_path / "flux_lora_diffusers.safetensors"
    save_file(state, str(path))
    none = dict.fromkeys(["scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2"])
    pipe = FluxPipeline(**none, tokenizer_2=None, transformer=theirs)
    compare(ours, theirs, state, load=lambda: pipe.load_lora_weights(str(path)))


def test_kohya_round_trip():
    ours = with_adapters(Flux(**TINY))
    adapters = kohya_flux.peft_adapters(ours)
    back = kohya_flux.from_kohya(kohya_flux.to_kohya(adapters), lora_targets(Flux(**TINY)))
    assert back.keys() == adapters.keys()
    for name, (down, up, alpha) in adapters.items():
        torch.testing.assert_close(back[name][0], down, rtol=0, atol=0)
        torch.testing.assert_close(back[name][1], up, rtol=0, atol=0)
        assert back[name][2] == alpha == ALPHA
    with pytest.raises(ValueError, match="lora_unet_double_blocks_9_img_attn_qkv"):
        kohya_flux.from_kohya(
            {"lora_unet_double_blocks_9_img_attn_qkv.lora_down.weight": torch.zeros(1, 1)},
            lora_targets(Flux(**TINY)),
        )
    schnell = Flux(**TINY, guidance_embed=False)
    linears = [n for n, m in schnell.named_modules() if isinstance(m, torch.nn.Linear)]
    dev_lora = {"lora_unet_guidance_in_in_layer.lora_down.weight": torch.zeros(1, 256)}
    with pytest.raises(ValueError, match="FLUX.1-dev's guidance input"):
        kohya_flux.from_kohya(dev_lora, linears)


def test_full_size_kohya_file_is_read_by_flux_pipeline(tmp_path):
    with torch.device("meta"):
        ours = flux1_dev()
        theirs = FluxTransformer2DModel(
            in_channels=64, num_layers=19, num_single_layers=38, guidance_embeds=True
        )
    targets = lora_targets(ours)
    assert len(targets) == 19 * 10 + 38 * 3
    torch.manual_seed(0)
    adapters = {}
    for name in targets:  # rank 1, alpha 1: the converter's alpha folding is then exact
        layer = ours.get_submodule(name)
        adapters[name] = (
            torch.randn(1, layer.in_features),
            torch.randn(layer.out_features, 1),
            1.0,
        )
    path = tmp_path / "flux_lora.safetensors"
    save_file(kohya_flux.to_kohya(adapters), str(path))
    read = FluxPipeline.lora_state_dict(str(path))
    ours_diffusers = kohya_flux.to_diffusers(adapters)
    assert sorted(read) == sorted(ours_diffusers)
    for key, tensor in ours_diffusers.items():
        torch.testing.assert_close(read[key], tensor, rtol=0, atol=0, msg=key)
    modules = dict(theirs.named_modules())
    for key, tensor in read.items():
        module = modules[key.removeprefix("transformer.").rsplit(".lora_", 1)[0]]
        if ".lora_A." in key:
            assert tensor.shape == (1, module.in_features), key
        else:
            assert tensor.shape == (module.out_features, 1), key


def test_adapter_names_inside_a_latent_diffusion_are_bfl_names():
    """A LatentDiffusion holds the backbone at model.diffusion_model; files name it bare."""
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.diffusion_model = with_adapters(Flux(**TINY))
    names = set(kohya_flux.peft_adapters(holder.model.diffusion_model))
    assert "double_blocks.0.img_attn.qkv" in names
    assert set(kohya_flux.peft_adapters(holder)) == names
    assert set(kohya_flux.peft_adapters(holder.model)) == names
