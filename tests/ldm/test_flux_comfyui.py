"""Our Flux LoRA files under ComfyUI's key rules (the table of docs/flux.md).

ComfyUI is not installed here, so its rules are restated from its source (comfyanonymous/ComfyUI
`comfy/lora.py` model_lora_keys_unet + load_lora, `comfy/utils.py` flux_to_diffusers,
`comfy/lora_convert.py` convert_lora), not from our code:
- the model holds BFL's names under `diffusion_model.`; for every `diffusion_model.X.weight` the
  LoRA names `lora_unet_` + X with `.` -> `_` and the bare `diffusion_model.X` both point at it;
- a Flux model also maps `transformer.` + every diffusers name, split ones to a row slice
  (dim 0, offset, size) of the fused BFL weight: to_q/k/v (and add_*_proj for the text stream) at
  0, h, 2h of width h, `proj_mlp` at 3h of width 4h (the single blocks' `linear1`);
- load_lora takes, per mapped name x, `x.lora_up.weight` + `x.lora_down.weight` (+ `x.alpha`) or
  `x.lora_B.weight` + `x.lora_A.weight`; any other key is logged "lora key not loaded";
- the patch is W[slice] += up @ down * (alpha / rank, or 1 without alpha);
- convert_lora rewrites only BFL control, Wan-Fun, USO and TwinFlow files, recognised by keys
  (`img_in.lora_A.weight` with `single_blocks.0.norm.key_norm.scale`,
  `lora_unet__blocks_0_cross_attn_k...`, `single_blocks.37.processor.qkv_lora.up.weight`,
  `t_embedder.`); ours must be none of them.
Each file is loaded under these rules into our tiny model's weights, which must then equal peft's
own merge of our adapters.
"""

import pytest
import torch

from ldm.flux import Flux
from ldm.layout import kohya_flux

pytest.importorskip("peft")
from flux_helpers import TINY, with_adapters  # noqa: E402

DOUBLE = {  # flux_to_diffusers' block_map (Linear weights)
    "attn.to_out.0": "img_attn.proj",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}


def comfyui_key_map(state_keys, depth: int, single: int, hidden: int) -> dict:
    """LoRA name -> (ComfyUI model weight, row slice (offset, size) or None)."""
    key_map = {}
    for k in state_keys:
        if k.endswith(".weight"):
            stem = k.removesuffix(".weight")
            key_map["lora_unet_" + stem.replace(".", "_")] = ("diffusion_model." + k, None)
            key_map["diffusion_model." + stem] = ("diffusion_model." + k, None)

    def to(name, rows=None):
        return ("diffusion_model." + name + ".weight", rows)

    for i in range(depth):
        for j, part in enumerate("qkv"):
            rows = (j * hidden, hidden)
            key_map[f"transformer.transformer_blocks.{i}.attn.to_{part}"] = to(
                f"double_blocks.{i}.img_attn.qkv", rows
            )
            key_map[f"transformer.transformer_blocks.{i}.attn.add_{part}_proj"] = to(
                f"double_blocks.{i}.txt_attn.qkv", rows
            )
        for theirs, ours in DOUBLE.items():
            key_map[f"transformer.transformer_blocks.{i}.{theirs}"] = to(
                f"double_blocks.{i}.{ours}"
            )
    for i in range(single):
        for j, part in enumerate("qkv"):
            key_map[f"transformer.single_transformer_blocks.{i}.attn.to_{part}"] = to(
                f"single_blocks.{i}.linear1", (j * hidden, hidden)
            )
        key_map[f"transformer.single_transformer_blocks.{i}.proj_mlp"] = to(
            f"single_blocks.{i}.linear1", (3 * hidden, 4 * hidden)
        )
        for theirs, ours in SINGLE.items():
            key_map[f"transformer.single_transformer_blocks.{i}.{theirs}"] = to(
                f"single_blocks.{i}.{ours}"
            )
    return key_map


def converted_by_comfyui(lora: dict) -> bool:
    return (
        ("img_in.lora_A.weight" in lora and "single_blocks.0.norm.key_norm.scale" in lora)
        or "lora_unet__blocks_0_cross_attn_k.lora_down.weight" in lora
        or "single_blocks.37.processor.qkv_lora.up.weight" in lora
        or any(k.startswith("t_embedder.") for k in lora)
    )


def comfyui_load(weights: dict, lora: dict, key_map: dict) -> tuple[dict, list]:
    """Patched copies of `weights` (ComfyUI model names) and the keys not loaded."""
    weights = {k: v.clone() for k, v in weights.items()}
    loaded = set()
    for x, (target, rows) in key_map.items():
        if f"{x}.lora_up.weight" in lora:
            up, down = f"{x}.lora_up.weight", f"{x}.lora_down.weight"
        elif f"{x}.lora_B.weight" in lora:
            up, down = f"{x}.lora_B.weight", f"{x}.lora_A.weight"
        else:
            continue
        alpha = lora.get(f"{x}.alpha")
        loaded |= {up, down} | ({f"{x}.alpha"} if alpha is not None else set())
        scale = alpha.item() / lora[down].shape[0] if alpha is not None else 1.0
        delta = lora[up].float() @ lora[down].float() * scale
        w = weights[target] if rows is None else weights[target].narrow(0, *rows)
        w += delta
    return weights, sorted(set(lora) - loaded)


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_comfyui_loads_every_key_and_gives_peft_merge(fmt):
    model = with_adapters(Flux(**TINY))
    base = {
        "diffusion_model." + name.replace(".base_layer", ""): p.detach()
        for name, p in model.named_parameters()
        if "lora_" not in name
    }
    adapters = kohya_flux.peft_adapters(model)
    lora = kohya_flux.to_kohya(adapters) if fmt == "kohya" else kohya_flux.to_diffusers(adapters)
    assert not converted_by_comfyui(lora)
    key_map = comfyui_key_map(
        [k.removeprefix("diffusion_model.") for k in base],
        TINY["depth"],
        TINY["depth_single_blocks"],
        TINY["hidden_size"],
    )
    patched, not_loaded = comfyui_load(base, lora, key_map)
    assert not_loaded == [], f"ComfyUI: lora key not loaded: {not_loaded[:3]}"
    # peft's own merge is the reference
    from peft.tuners.lora import LoraLayer

    expected = dict(base)
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            key = "diffusion_model." + name + ".weight"
            expected[key] = base[key] + layer.get_delta_weight("default")
    changed = 0
    for key, weight in expected.items():
        torch.testing.assert_close(patched[key], weight, rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(weight, base[key])
    assert changed == len(adapters)
