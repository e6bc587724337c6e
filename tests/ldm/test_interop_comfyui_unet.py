"""Our kohya LoRA / LoCon / DoRA files of SD 1.x, SD 2.x and SDXL under ComfyUI's own rules.

ComfyUI is not installed here, so its rules are restated from its source (comfyanonymous/ComfyUI,
lora.py read at 41444b5):
- the names its model holds: `diffusion_model.<original UNet name>`; SD 1.x's CLIP as
  `clip_l.transformer.text_model...`, SD 2.x's OpenCLIP as `clip_h.transformer.text_model...` and
  SDXL's as `clip_l` + `clip_g` (supported_models.py `process_clip_state_dict`), OpenCLIP blocks
  renamed to HF CLIP ones with the fused in_proj cut into q/k/v rows (utils.py
  `transformers_convert`);
- the LoRA names that point at them (lora.py `model_lora_keys_unet`, `model_lora_keys_clip`):
  `lora_unet_` + original name, `lora_unet_` + diffusers name by utils.py `unet_to_diffusers`
  (its config detected from the keys as model_detection.py `detect_unet_config` does),
  `lora_te_` / `lora_te1_` / `lora_te2_` + HF CLIP name;
- what a file's keys become (lora.py `load_lora`): `x.lora_up.weight` + `x.lora_down.weight`
  (+ `x.alpha`, `x.dora_scale`) or `x.lora_B.weight` + `x.lora_A.weight`; every other key is
  "lora key not loaded";
- the patch (weight_adapter/lora.py `calculate_weight`): diff = up.flatten(1) @ down.flatten(1)
  reshaped to the weight, scale alpha / rank (1 without alpha), W + strength * scale * diff, or
  `weight_decompose` for DoRA (tests/ldm/test_lora_interop.py transcribes it).

Under these rules every key of our file loads and the patched weights equal peft's own merge of
the adapters we trained - no name of ours on the ComfyUI side. Adapters have random nonzero
lora_B and moved DoRA magnitudes, so a swapped name, a lost alpha or a transposed conv shows.
"""

import copy
import re

import pytest
import torch
import yaml
from lora_helpers import build, randomize_adapters
from sdxl_helpers import tiny_sdxl_config
from test_lora_interop import comfyui_weight_decompose

from ldm import lora
from ldm.layout.original import (
    CLIP_PREFIX,
    OPENCLIP_PREFIX,
    SGM_CLIP_PREFIX,
    SGM_OPENCLIP_PREFIX,
    UNET_PREFIX,
)

pytest.importorskip("peft")

LOCON = "rank: 2, alpha: 1, targets: [attn, proj, ff, conv], conv_rank: 3, conv_alpha: 6"
TEXT = "text_encoder: {rank: 2, alpha: 4}"
OPENCLIP = {"width": 32, "layers": 3, "heads": 2, "embed_dim": 32}

# --- ComfyUI's names for our base weights --------------------------------------------------------

# utils.py transformers_convert: OpenCLIP block -> HF CLIP layer (in_proj handled apart)
OPENCLIP_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


def _openclip_names(rest: str, tower: str) -> dict:
    """One OpenCLIP tensor name -> {ComfyUI name: row slice or None}."""
    found = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)", rest)
    found_qkv = re.fullmatch(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)", rest)
    layer = f"{tower}.transformer.text_model.encoder.layers."
    if found_qkv:
        n, end = found_qkv.groups()
        return {f"{layer}{n}.self_attn.{p}_proj.{end}": i for i, p in enumerate("qkv")}
    if found and found[2] in OPENCLIP_BLOCK:
        return {f"{layer}{found[1]}.{OPENCLIP_BLOCK[found[2]]}.{found[3]}": None}
    return {}


def comfyui_names(state: dict) -> dict:
    """ComfyUI name -> (our name, which third of a fused q/k/v or None), for the weights of the
    UNet and text encoders (process_clip_state_dict of SD15, SD20, SDXL)."""
    sdxl = any(k.startswith(SGM_CLIP_PREFIX) for k in state)
    towers = [
        (UNET_PREFIX, "diffusion_model.", False),
        (CLIP_PREFIX, "clip_l.transformer.", False),
        (SGM_CLIP_PREFIX, "clip_l.transformer.", False),
        (OPENCLIP_PREFIX, "clip_h", True),
        (SGM_OPENCLIP_PREFIX, "clip_g", True),
    ]
    names = {}
    for key in state:
        for ours, theirs, openclip in towers:
            if not key.startswith(ours):
                continue
            rest = key.removeprefix(ours)
            if openclip:
                names.update({k: (key, part) for k, part in _openclip_names(rest, theirs).items()})
            else:
                names[theirs + rest] = (key, None)
    assert sdxl == any(k.startswith("clip_g.") for k in names)
    return names


def comfyui_weight(state: dict, where: tuple) -> torch.Tensor:
    key, part = where
    if part is None:
        return state[key]
    return state[key].chunk(3)[part]


# --- utils.py unet_to_diffusers, its config detected as model_detection.py does ------------------

RESNET = {
    "in_layers.2": "conv1",
    "emb_layers.1": "time_emb_proj",
    "out_layers.3": "conv2",
    "skip_connection": "conv_shortcut",
}
ATTENTION = ("proj_in", "proj_out")
TRANSFORMER = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
TRANSFORMER += tuple(t.replace("attn1", "attn2") for t in TRANSFORMER) + (
    "ff.net.0.proj",
    "ff.net.2",
)
BASIC = {
    "label_emb.0.0": "add_embedding.linear_1",
    "label_emb.0.2": "add_embedding.linear_2",
    "input_blocks.0.0": "conv_in",
    "out.2": "conv_out",
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
}


def _depth(keys, prefix: str) -> int:
    """model_detection.py count_blocks of `<prefix>1.transformer_blocks.N`."""
    depth = 0
    while any(k.startswith(f"{prefix}1.transformer_blocks.{depth}.") for k in keys):
        depth += 1
    return depth


def unet_to_diffusers(keys) -> dict:
    """diffusers UNet module path -> original module path (Linear / conv weights only)."""
    keys = [k.removeprefix("diffusion_model.") for k in keys]
    blocks, levels, in_depth = 0, [0], {}
    while any(k.startswith(f"input_blocks.{blocks}.") for k in keys):
        if f"input_blocks.{blocks}.0.op.weight" in keys:
            levels.append(0)  # a Downsample starts the next level
        elif f"input_blocks.{blocks}.0.in_layers.0.weight" in keys:
            levels[-1] += 1
            in_depth[blocks] = _depth(keys, f"input_blocks.{blocks}.")
        blocks += 1
    out_depth = {n: _depth(keys, f"output_blocks.{n}.") for n in range(blocks)}
    mid_depth = _depth(keys, "middle_block.")

    paths = {}

    def transformer(theirs: str, ours: str, depth: int) -> None:
        for name in ATTENTION:
            paths[f"{theirs}.{name}"] = f"{ours}.{name}"
        for t in range(depth):
            for name in TRANSFORMER:
                paths[f"{theirs}.transformer_blocks.{t}.{name}"] = (
                    f"{ours}.transformer_blocks.{t}.{name}"
                )

    def resnet(theirs: str, ours: str) -> None:
        for o, t in RESNET.items():
            paths[f"{theirs}.{t}"] = f"{ours}.{o}"

    for x, res_blocks in enumerate(levels):
        n = 1 + (res_blocks + 1) * x
        for i in range(res_blocks):
            resnet(f"down_blocks.{x}.resnets.{i}", f"input_blocks.{n}.0")
            if in_depth[n]:
                transformer(f"down_blocks.{x}.attentions.{i}", f"input_blocks.{n}.1", in_depth[n])
            n += 1
        paths[f"down_blocks.{x}.downsamplers.0.conv"] = f"input_blocks.{n}.0.op"
    transformer("mid_block.attentions.0", "middle_block.1", mid_depth)
    resnet("mid_block.resnets.0", "middle_block.0")
    resnet("mid_block.resnets.1", "middle_block.2")
    for x, res_blocks in enumerate(reversed(levels)):
        n = (res_blocks + 1) * x
        for i in range(res_blocks + 1):
            resnet(f"up_blocks.{x}.resnets.{i}", f"output_blocks.{n}.0")
            c = 1
            if out_depth[n]:
                c = 2
                transformer(f"up_blocks.{x}.attentions.{i}", f"output_blocks.{n}.1", out_depth[n])
            if i == res_blocks:
                paths[f"up_blocks.{x}.upsamplers.0.conv"] = f"output_blocks.{n}.{c}.conv"
            n += 1
    paths.update({t: o for o, t in BASIC.items()})
    return paths


# --- lora.py: the names a file may use, and load_lora ---------------------------------------------

CLIP_LAYERS = {
    "mlp.fc1": "mlp_fc1",
    "mlp.fc2": "mlp_fc2",
    "self_attn.k_proj": "self_attn_k_proj",
    "self_attn.q_proj": "self_attn_q_proj",
    "self_attn.v_proj": "self_attn_v_proj",
    "self_attn.out_proj": "self_attn_out_proj",
}


def comfyui_key_map(names) -> dict:
    """LoRA name -> ComfyUI weight name (model_lora_keys_clip, then model_lora_keys_unet)."""
    key_map = {}
    clip_l = any(k.startswith("clip_l.") for k in names)
    for b in range(32):
        for hf, kohya in CLIP_LAYERS.items():
            for tower in ("clip_h", "clip_l", "clip_g"):
                k = f"{tower}.transformer.text_model.encoder.layers.{b}.{hf}.weight"
                if k not in names:
                    continue
                if tower == "clip_g" and clip_l:
                    aliases = [f"lora_te2_text_model_encoder_layers_{b}_{kohya}"]
                    aliases.append(f"text_encoder_2.text_model.encoder.layers.{b}.{hf}")
                else:
                    aliases = [f"lora_te_text_model_encoder_layers_{b}_{kohya}"]
                    aliases.append(f"text_encoder.text_model.encoder.layers.{b}.{hf}")
                    if tower != "clip_g":
                        aliases.append(f"lora_te1_text_model_encoder_layers_{b}_{kohya}")
                key_map.update(dict.fromkeys(aliases, k))
    for k in names:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_map["lora_unet_" + k[16:-7].replace(".", "_")] = k
    for theirs, ours in unet_to_diffusers(names).items():
        weight = f"diffusion_model.{ours}.weight"
        key_map["lora_unet_" + theirs.replace(".", "_")] = weight
        for prefix in ("", "unet."):
            old = prefix + theirs.replace(".to_", ".processor.to_")
            key_map[old.removesuffix(".0") if old.endswith(".to_out.0") else old] = weight
    return key_map


def comfyui_load(base: dict, file: dict, strength: float = 1.0) -> dict:
    """`base` (our names) patched by `file` as ComfyUI patches its model; fails on any key left."""
    names = comfyui_names(base)
    patched = {k: comfyui_weight(base, where).clone() for k, where in names.items()}
    loaded = set()
    for x, target in comfyui_key_map(names).items():
        for up_name, down_name in (("lora_up", "lora_down"), ("lora_B", "lora_A")):
            up, down = file.get(f"{x}.{up_name}.weight"), file.get(f"{x}.{down_name}.weight")
            if up is None:
                continue
            alpha, dora_scale = file.get(f"{x}.alpha"), file.get(f"{x}.dora_scale")
            loaded |= {f"{x}.{up_name}.weight", f"{x}.{down_name}.weight"}
            loaded |= {f"{x}.alpha", f"{x}.dora_scale"}
            weight = patched[target]
            scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
            diff = (up.float().flatten(1) @ down.float().flatten(1)).reshape(weight.shape)
            if dora_scale is None:
                patched[target] = weight + strength * scale * diff
            else:
                patched[target] = comfyui_weight_decompose(
                    dora_scale.float(), weight, diff, scale, strength
                )
            break
    not_loaded = sorted(set(file) - loaded)
    assert not not_loaded, f"ComfyUI: lora key not loaded: {not_loaded[:3]} ({len(not_loaded)})"
    return patched


# --- the files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def configs(tmp_path_factory, tiny_config):
    root = tmp_path_factory.mktemp("comfyui")
    v2 = yaml.safe_load(tiny_config.read_text())
    v2["model"]["params"]["cond_stage_config"] = {
        "target": "ldm.text_encoder.FrozenOpenCLIPEmbedder",
        "params": {**OPENCLIP, "layer": "penultimate"},
    }
    (root / "v2.yaml").write_text(yaml.safe_dump(v2))
    (root / "sdxl.yaml").write_text(yaml.safe_dump(tiny_sdxl_config()))
    return {"sd1": tiny_config, "sd2": root / "v2.yaml", "sdxl": root / "sdxl.yaml"}


UNET = "model.params.unet_config.params"
CASES = {
    # LoRA, LoCon and DoRA on every group, text encoder too
    "sd1-locon-dora": ("sd1", f"{{{LOCON}, dora: true, {TEXT}}}", ()),
    # SD 1.5's shape: a level without attention whose upsampler is output_blocks.N.1.conv
    "sd1-locon-no-attention-level": (
        "sd1",
        f"{{{LOCON}}}",
        (f"{UNET}.attention_resolutions=[1]",),
    ),
    # SD 2.x: OpenCLIP's fused q/k/v written as three q_proj / k_proj / v_proj LoRAs
    "sd2-locon": ("sd2", f"{{{LOCON}, text_encoder: {{rank: 3, alpha: 5}}}}", ()),
    # SDXL: UNet by original names, te1 (CLIP-L) and te2 (bigG), depth 2 at the lowest level
    "sdxl-locon": ("sdxl", f"{{{LOCON}, {TEXT}}}", ()),
    "sdxl-dora": ("sdxl", "{rank: 3, alpha: 6, dora: true}", ()),
}


def base_weights(model) -> dict:
    """The base weights under their original names (peft's levels removed)."""
    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    return {k: v for k, v in saved["state_dict"].items() if not k.startswith("lora.")}


# a strength != 1 once per rule: LoRA (linear) and DoRA (ComfyUI's weight_decompose)
RUNS = [(case, 1.0) for case in sorted(CASES)] + [("sd1-locon-dora", 0.6), ("sdxl-locon", 0.6)]


@pytest.mark.parametrize("case, strength", RUNS)
def test_comfyui_loads_every_key_of_our_kohya_file_and_gives_peft_merge(configs, case, strength):
    family, settings, overrides = CASES[case]
    model = build(configs[family], settings, overrides=overrides).eval()
    randomize_adapters(model)
    file = {k: v.clone() for k, v in lora.kohya_state_dict(model).items()}
    base = base_weights(model)

    got = comfyui_load(base, file, strength)

    merged = copy.deepcopy(model)
    layers = lora.merge_adapters(merged, weight=strength)
    expected_state = merged.state_dict()
    expected = {
        k: comfyui_weight(expected_state, where) for k, where in comfyui_names(base).items()
    }
    changed = 0
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=3e-5, msg=k)
        changed += bool(
            (expected[k] - comfyui_weight(base, comfyui_names(base)[k])).abs().max() > 1e-3
        )
    # every adapted layer moved (OpenCLIP's in_proj as its three parts)
    assert changed >= layers, (changed, layers)


def test_restated_unet_to_diffusers_pairs_sdxl_names(configs):
    """The restated unet_to_diffusers on the tiny SDXL (no attention at the top level, depth 2
    at the lowest): a diffusers-path name and kohya's original name reach the same weight."""
    names = comfyui_names(base_weights(build(configs["sdxl"], None)))
    key_map = comfyui_key_map(names)
    pairs = {
        "input_blocks_3_1_transformer_blocks_0_attn1_to_q": (
            "down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
        ),
        "input_blocks_5_1_transformer_blocks_1_attn2_to_k": (
            "down_blocks_2_attentions_0_transformer_blocks_1_attn2_to_k"
        ),
        "input_blocks_2_0_op": "down_blocks_0_downsamplers_0_conv",
        "output_blocks_3_2_conv": "up_blocks_1_upsamplers_0_conv",
        "output_blocks_5_0_skip_connection": "up_blocks_2_resnets_1_conv_shortcut",
        "label_emb_0_0": "add_embedding_linear_1",
    }
    for original, diffusers in pairs.items():
        assert key_map["lora_unet_" + original] == key_map["lora_unet_" + diffusers], original
