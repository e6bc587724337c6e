"""LoRA on the SD3 / SD 3.5 MMDiT through ldm.lora (targets from ldm.mmdit, files from
ldm.layout.kohya_sd3), checked against the other tools' own rules:
- diffusers: our diffusers-format file, read by `StableDiffusion3Pipeline.lora_state_dict` and
  loaded with `SD3Transformer2DModel.load_lora_adapter` into a diffusers transformer holding our
  base weights (converted by diffusers' own single-file converter), gives our output;
- ComfyUI (not installed here; its rules restated from comfyanonymous/ComfyUI `comfy/lora.py`
  model_lora_keys_unet + load_lora and `comfy/utils.py` mmdit_to_diffusers): for every
  `diffusion_model.X.weight` the name `lora_unet_` + X with `.` -> `_` points at it; an SD3 model
  also maps `transformer.` + each diffusers name to its weight, split q/k/v to a row slice (the
  slices come here from diffusers' converter itself); load_lora takes `x.lora_up.weight` +
  `x.lora_down.weight` (+ `x.alpha`) or `x.lora_B.weight` + `x.lora_A.weight`, any other key is
  "not loaded"; the patch is W[slice] += up @ down * (alpha / rank, or 1 without alpha).
  Both our files, loaded so, must give peft's own merge of our adapters.
"""

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ldm import lora
from ldm.mmdit import MMDiT
from ldm.util import instantiate_from_config

pytest.importorskip("peft")
single_file_utils = pytest.importorskip("diffusers.loaders.single_file_utils")
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "tiny.yaml"
RANK, ALPHA = 4, 2.0  # scale 1/2: an alpha not folded shows
convert = single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers


def base_state(model) -> dict:
    """The backbone's frozen weights under Stability's names (without peft's levels)."""
    return {
        n.replace(".base_layer", ""): p.detach().clone()
        for n, p in model.backbone.state_dict().items()
        if "lora_" not in n
    }


@pytest.fixture(scope="module")
def model():
    cfg = OmegaConf.load(TINY).model
    cfg.params.lora = {"rank": RANK, "alpha": ALPHA}
    model = instantiate_from_config(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # non-zero everywhere: adaLN-Zero and lora_B = 0 would hide the rest
        for name, param in model.backbone.named_parameters():
            param.copy_(
                0.1 * torch.randn_like(param) + name.endswith(("ln_q.weight", "ln_k.weight"))
            )
    return model


def test_targets_are_the_attention_and_mlp_of_both_streams(model):
    """Block 0 (MMDiT-X): context attn qkv/proj + mlp fc1/fc2, x attn, attn2, mlp = 10 layers;
    the last block's context stream is pre_only (qkv only) + x's 4 = 5; no adaLN layer."""
    adapted = set(lora.adapter_layers(model.backbone))
    assert len(adapted) == 15
    plain = MMDiT(**OmegaConf.load(TINY).model.params.backbone_config.params)
    assert adapted == {
        n
        for n, m in plain.named_modules()
        if isinstance(m, nn.Linear) and n.startswith("joint_blocks.") and "adaLN" not in n
    }
    assert {"joint_blocks.0.x_block.attn2.qkv", "joint_blocks.1.context_block.attn.qkv"} <= adapted


def inputs():
    torch.manual_seed(3)
    x, ctx, pooled = torch.randn(2, 16, 8, 6), torch.randn(2, 5, 48), torch.randn(2, 40)
    return x, torch.tensor([100.0, 700.0]), ctx, pooled


def test_diffusers_loader_gives_our_output(model):
    cfg = OmegaConf.load(TINY).model.params.backbone_config.params
    theirs = SD3Transformer2DModel(
        sample_size=cfg.sample_size, patch_size=2, in_channels=16, out_channels=16,
        num_layers=cfg.depth, attention_head_dim=cfg.hidden_size // cfg.num_heads,
        num_attention_heads=cfg.num_heads, joint_attention_dim=cfg.context_dim,
        caption_projection_dim=cfg.hidden_size, pooled_projection_dim=cfg.pooled_dim,
        pos_embed_max_size=cfg.pos_embed_max_size, qk_norm="rms_norm",
        dual_attention_layers=tuple(cfg.dual_attention_layers),
    ).eval()  # fmt: skip
    theirs.load_state_dict(convert(base_state(model)), strict=True)
    state = StableDiffusion3Pipeline.lora_state_dict(lora.diffusers_state_dict(model))
    theirs.load_lora_adapter(state, prefix="transformer")
    x, t, ctx, pooled = inputs()
    with torch.no_grad():
        got = model.backbone(x, t, {"crossattn": ctx, "vector": pooled})
        plain = theirs(x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t)
        theirs.disable_lora()
        without = theirs(x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t)
    assert (got - without.sample).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(plain.sample, got, rtol=1e-4, atol=1e-4)


def comfyui_key_map(base: dict) -> dict:
    """LoRA name -> (our weight name, row slice (offset, size) or None), ComfyUI's rules; the
    diffusers names and slices found by running diffusers' converter on weights that tell their
    rows apart."""
    key_map = {}
    for k in base:
        if k.endswith(".weight"):
            key_map["lora_unet_" + k.removesuffix(".weight").replace(".", "_")] = (k, None)
    tagged, offset = {}, 0
    for k, v in base.items():
        tagged[k] = torch.arange(offset, offset + v.numel(), dtype=torch.float64).reshape(v.shape)
        offset += v.numel()
    for name, weight in convert(copy.deepcopy(tagged)).items():
        if not name.endswith(".weight") or weight.dim() != 2:
            continue
        for k, v in tagged.items():
            if v.dim() == 2 and v.shape[1] == weight.shape[1]:
                start = int(((weight[0, 0] - v[0, 0]) / v.shape[1]).item())
                if 0 <= start < v.shape[0] and torch.equal(v[start : start + len(weight)], weight):
                    rows = None if len(weight) == len(v) else (start, len(weight))
                    key_map["transformer." + name.removesuffix(".weight")] = (k, rows)
    return key_map


def comfyui_load(base: dict, file: dict) -> dict:
    key_map, patched, loaded = comfyui_key_map(base), copy.deepcopy(base), set()
    for name, (weight, rows) in key_map.items():
        for up_key, down_key in (("lora_up", "lora_down"), ("lora_B", "lora_A")):
            up, down = file.get(f"{name}.{up_key}.weight"), file.get(f"{name}.{down_key}.weight")
            if up is None:
                continue
            alpha = file.get(f"{name}.alpha")
            scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
            target = patched[weight] if rows is None else patched[weight][rows[0] : sum(rows)]
            target += up.float() @ down.float() * scale
            loaded |= {f"{name}.{up_key}.weight", f"{name}.{down_key}.weight", f"{name}.alpha"}
    not_loaded = set(file) - loaded
    assert not not_loaded, f"ComfyUI: lora key not loaded: {sorted(not_loaded)[:3]}"
    return patched


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_comfyui_loads_every_key_and_gives_peft_merge(model, fmt):
    file = lora.kohya_state_dict(model) if fmt == "kohya" else lora.diffusers_state_dict(model)
    if fmt == "kohya":  # the names kohya's sd3 network writes: lora_unet_ + module, `.` -> `_`
        assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight" in file
        assert file["lora_unet_joint_blocks_0_x_block_attn_qkv.alpha"] == ALPHA
    got = comfyui_load(base_state(model), file)
    merged = copy.deepcopy(model)
    assert lora.merge_adapters(merged) == 15
    expected = merged.backbone.state_dict()
    assert got.keys() == expected.keys()
    for k in got:
        torch.testing.assert_close(got[k], expected[k], msg=k)


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_file_merges_back(model, fmt):
    """Our reader (merge_file, as scripts/lora.py and txt2img --lora use it) of our kohya or
    diffusers file on the plain model gives peft's merge; a file of another family is one clear
    error."""
    merged = copy.deepcopy(model)
    lora.merge_adapters(merged)
    plain = copy.deepcopy(model)
    lora._unload(plain)
    file = lora.kohya_state_dict(model) if fmt == "kohya" else lora.diffusers_state_dict(model)
    assert lora.merge_file(plain, file, source="sd3.safetensors") == 15
    for k, v in merged.backbone.state_dict().items():
        torch.testing.assert_close(plain.backbone.state_dict()[k], v, msg=k)
    down = lora.kohya_state_dict(model)[
        "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight"
    ]
    with pytest.raises(ValueError, match="lora_unet_input_blocks_1_1_proj_in names no Linear"):
        lora.merge_file(plain, {"lora_unet_input_blocks_1_1_proj_in.lora_down.weight": down})


def test_dora_on_mmdit_is_one_clear_error():
    cfg = OmegaConf.load(TINY).model
    cfg.params.lora = {"rank": RANK, "dora": True}
    with pytest.raises(ValueError, match=r"^model.params.lora.dora: the SD3 MMDiT LoRA files"):
        instantiate_from_config(cfg)
