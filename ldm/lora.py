"""LoRA, LoCon and DoRA adapters (peft) on the UNet and the CLIP text encoder, and their files.

LoRA (Hu et al. 2021, arXiv:2106.09685) trains a low-rank update W + (alpha / r) * B A of a
frozen weight W (A: r x in, B: out x r, B starts at zero). LoCon (LyCORIS) puts the same update on
the ResBlock and resampler convolutions (A is a kh x kw conv, B a 1x1 conv), usually with its own
rank. DoRA (Liu et al. 2024, arXiv:2402.09353) also learns the magnitude of each output row:
W' = m * (W + s B A) / ||W + s B A||. The layers are peft's; this module chooses which layers get
them (the groups kohya-ss's networks use), keeps the base frozen in the training dtype, and
writes and reads the kohya file format that AUTOMATIC1111, ComfyUI, Forge and diffusers load.
Checkpoint key rules live in `ldm.layout.peft`, kohya / diffusers names in `ldm.layout.kohya`.
"""

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from ldm.layout import kohya as lora_kohya
from ldm.layout import original, peft, wrappers

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name for the adapters we train
# Layers per target group, by the end of their CompVis name (UNetModel / SpatialTransformer).
UNET_GROUPS = {
    "attn": r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)",
    "proj": r"\.(proj_in|proj_out)",
    "ff": r"\.ff\.net\.(0\.proj|2)",
    # LoCon: ResBlock convs, time-embedding projection and shortcut, Downsample / Upsample.
    "conv": r"\.(in_layers\.2|out_layers\.3|emb_layers\.1|skip_connection|op|conv)",
}
TEXT_LAYERS = r"(^|\.)encoder\.layers\.(\d+)\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
OPENCLIP_LAYERS = r"transformer\.resblocks\.(\d+)\.(attn\.out_proj|mlp\.c_fc|mlp\.c_proj)"
BASE_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INITS = {"default": True, "gaussian": "gaussian"}  # peft's init_lora_weights: B = 0 for both


@dataclasses.dataclass(frozen=True)
class TextEncoderLora:
    """LoRA on the CLIP text encoder's attention and MLP layers (kohya's `lora_te_` modules).

    rank, alpha (default: rank), dropout: as for the UNet. lr: its own learning rate (default
    the model's; kohya's `--text_encoder_lr`)."""

    rank: int = 4
    alpha: float | None = None
    dropout: float = 0.0
    lr: float | None = None


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """`model.params.lora` of `LatentDiffusion`: which layers get adapters, and how.

    rank: r of the update B A (4-128 are common). alpha: the update is scaled by alpha / rank
        (default alpha = rank: scale 1; kohya's train_network default is alpha 1).
    dropout: dropout on the adapters' input (LoRA paper, Sec. 4).
    targets: UNet layer groups: "attn" (to_q/k/v/out.0 of self- and cross-attention), "proj"
        (the transformers' proj_in/proj_out), "ff" (feed-forward), "conv" (LoCon: ResBlock
        convolutions, time-embedding projections and shortcuts, down/upsampler convs). The
        default [attn, proj, ff] is kohya's default network.
    conv_rank, conv_alpha: rank and alpha of the 3x3 convolutions of "conv" (kohya's
        conv_dim / conv_alpha), its Linear and 1x1 layers use rank and alpha. Neither set: the
        3x3 convolutions use rank and alpha too. conv_rank set without conv_alpha: conv_alpha
        is 1, kohya's rule (sd-scripts networks/lora.py `create_network`: "if conv_alpha is None:
        conv_alpha = 1.0"), so conv_dim=8 means the same in both (docs/lora-rules.md).
    dora: DoRA (also learn each output row's magnitude).
    init: "default" (peft: Kaiming-uniform A, zero B) or "gaussian" (A ~ N(0, 1/r), zero B).
    text_encoder: also train LoRA on the CLIP text encoder: `{rank, alpha, dropout, lr}`.
    base_dtype: the frozen weights' dtype while training: "auto" = the trainer's precision
        (bf16 / fp16 under bf16-mixed / 16-mixed, single device or DDP; FSDP and DeepSpeed
        manage dtypes themselves), or "fp32", "bf16", "fp16". Adapters stay float32.
    base_quantization: the frozen backbone's Linear weights stored quantized while training
        (`ldm.quantize`): "none", "int8" / "nf4" (bitsandbytes), "fp8" (float8_e4m3fn storage,
        also the convolutions), or "auto": the first of none, fp8, int8, nf4 whose memory plan
        fits the device (`lun.memory_quant`). The adapters and their files are the same.
    blocks_to_swap: this many of the backbone's blocks live in host RAM and are streamed to the
        device ahead of use (`ldm.block_swap`); 0: none.
    """

    rank: int = 4
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attn", "proj", "ff")
    conv_rank: int | None = None
    conv_alpha: float | None = None
    dora: bool = False
    init: str = "default"
    text_encoder: TextEncoderLora | None = None
    base_dtype: str = "auto"
    base_quantization: str = "none"
    blocks_to_swap: int = 0

    @property
    def scale_alpha(self) -> float:
        """The alpha of the Linear and 1x1 layers: `alpha`, or rank (scale 1) when not set."""
        return self.alpha if self.alpha is not None else self.rank

    @property
    def conv(self) -> tuple[int, float]:
        """(rank, alpha) of the 3x3 convolutions: the one owner of the LoCon rule above."""
        if self.conv_rank is None:
            return self.rank, self.conv_alpha if self.conv_alpha is not None else self.scale_alpha
        return self.conv_rank, self.conv_alpha if self.conv_alpha is not None else 1.0


def _fail(key: str, why: str):
    raise ValueError(f"model.params.lora.{key}: {why}")


def _check_rank_alpha(prefix: str, values: Mapping) -> None:
    rank = values.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        _fail(prefix + "rank", f"must be a positive integer, got {rank!r}")
    alpha = values.get("alpha")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0
    ):
        _fail(prefix + "alpha", f"must be a positive number, got {alpha!r}")
    dropout = values.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        _fail(prefix + "dropout", f"must be in [0, 1), got {dropout!r}")


def parse_settings(config: Mapping | None) -> LoraSettings | None:
    """`model.params.lora` -> LoraSettings (None: no LoRA); ValueError naming the bad key."""
    if config is None or config is False:
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"model.params.lora: must be a mapping, got {config!r}")
    fields = {f.name for f in dataclasses.fields(LoraSettings)}
    for key in config:
        if key not in fields:
            _fail(key, f"unknown key; known: {', '.join(sorted(fields))}")
    values = dict(config)
    _check_rank_alpha("", values)
    _check_rank_alpha("conv_", {"rank": values.get("conv_rank"), "alpha": values.get("conv_alpha")})
    targets = values.get("targets", LoraSettings.targets)
    if isinstance(targets, str) or not targets or any(t not in UNET_GROUPS for t in targets):
        _fail("targets", f"must be a list of {', '.join(UNET_GROUPS)}, got {targets!r}")
    values["targets"] = tuple(targets)
    if not isinstance(values.get("dora", False), bool):
        _fail("dora", f"must be true or false, got {values['dora']!r}")
    if values.get("init", "default") not in INITS:
        _fail("init", f"must be one of {', '.join(INITS)}, got {values['init']!r}")
    if values.get("base_dtype", "auto") not in BASE_DTYPES:
        _fail(
            "base_dtype", f"must be one of {', '.join(BASE_DTYPES)}, got {values['base_dtype']!r}"
        )
    _check_quantization(values)
    text = values.get("text_encoder")
    if text is not None:
        if not isinstance(text, Mapping):
            _fail("text_encoder", f"must be a mapping {{rank, alpha, dropout, lr}}, got {text!r}")
        known = {f.name for f in dataclasses.fields(TextEncoderLora)}
        for key in text:
            if key not in known:
                _fail(f"text_encoder.{key}", f"unknown key; known: {', '.join(sorted(known))}")
        _check_rank_alpha("text_encoder.", text)
        lr = text.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0):
            _fail("text_encoder.lr", f"must be a positive number, got {lr!r}")
        values["text_encoder"] = TextEncoderLora(**text)
    return LoraSettings(**values)


def _check_quantization(values: Mapping) -> None:
    from ldm.quantize import KINDS

    kind = values.get("base_quantization", "none")
    if kind not in KINDS:
        _fail("base_quantization", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "none" and values.get("dora", False):
        _fail(
            "base_quantization",
            "DoRA reads the base weights' row norms; use a full-precision base (none) or dora: false",
        )
    swap = values.get("blocks_to_swap", 0)
    if isinstance(swap, bool) or not isinstance(swap, int) or swap < 0:
        _fail("blocks_to_swap", f"must be a whole number >= 0, got {swap!r}")
    if swap and kind == "int8":  # Linear8bitLt keeps its own reference to the int8 weight
        _fail("blocks_to_swap", "not with an int8 base (bitsandbytes); use fp8 or nf4")


# --- which layers --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
    """A transformer backbone that owns its LoRA rules: `targets(backbone)` names the Linear
    layers LoRA adapts, `layout` (an ldm.layout.kohya_* module) writes and reads its files:
    `peft_adapters`, `to_kohya`, `from_kohya`, `to_diffusers`. The UNet's rules stay here and in
    ldm.lora_kohya."""

    name: str
    targets: object
    layout: object


def backbone_family(backbone: nn.Module) -> Family | None:
    """The LoRA rules of `backbone` (a LatentDiffusion's `backbone`), or None for the UNet: the
    one place that tells the families apart."""
    from ldm import flux, mmdit
    from ldm.layout import kohya_flux, kohya_sd3

    if isinstance(backbone, mmdit.MMDiT):
        return Family("SD3 MMDiT", mmdit.lora_targets, kohya_sd3)
    if isinstance(backbone, flux.Flux):
        return Family("Flux", flux.lora_targets, kohya_flux)
    return None


def _lora_able(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d))


def unet_targets(unet: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Names (in `unet`) of the Linear / Conv2d layers of the target groups, in module order."""
    pattern = re.compile("(" + "|".join(UNET_GROUPS[t] for t in targets) + ")$")
    return [n for n, m in unet.named_modules() if _lora_able(m) and pattern.search("." + n)]


def text_targets(text_model: nn.Module, used_layers: int | None = None) -> list[str]:
    """Names (in a CLIP text model) of kohya's `lora_te_` layers (attention and MLP), of its
    first `used_layers` encoder layers (default all)."""
    found = [(n, re.search(TEXT_LAYERS + "$", n)) for n, m in text_model.named_modules()]
    return [n for n, f in found if f and int(f[2]) < (used_layers or math.inf)]


def _used_clip_layers(encoder: nn.Module) -> int | None:
    """The CLIP layers a `layer: hidden` embedder reads (hidden_states[k] is the output of layer
    k - 1; SDXL's layer_idx 11 leaves the last of 12 out): adapters on the others would get no
    gradient, which DDP refuses. None: all."""
    if getattr(encoder, "layer", None) != "hidden":
        return None
    layers = _clip_text_model(encoder).config.num_hidden_layers
    return encoder.layer_idx % (layers + 1)


def _inject(
    module: nn.Module,
    names: list[str],
    ranks: dict,
    alphas: dict,
    adapter: str = ADAPTER,
    **kwargs,
) -> None:
    """peft LoRA layers on `names` (in `module`), with a rank and alpha per layer."""
    from peft import LoraConfig, inject_adapter_in_model

    default_rank = max(set(ranks.values()), key=list(ranks.values()).count)
    default_alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config = LoraConfig(
        r=default_rank,
        lora_alpha=default_alpha,
        target_modules=names,
        rank_pattern={re.escape(n): r for n, r in ranks.items() if r != default_rank},
        alpha_pattern={re.escape(n): a for n, a in alphas.items() if a != default_alpha},
        **kwargs,
    )
    inject_adapter_in_model(config, module, adapter_name=adapter)
    made = {layer_name(n) for n, m in module.named_modules() if _is_lora_layer(m)}
    asked = {*names, *(p.rpartition(".")[0] for p in kwargs.get("target_parameters", ()))}
    if made != asked:  # peft matches names by suffix: check that it took exactly these
        raise RuntimeError(f"peft adapted {len(made)} layers, asked for {len(asked)}")


def layer_name(name: str) -> str:
    """A LoRA layer's module name without peft's `base_layer` levels (a layer inside a wrapped
    one: OpenCLIP's `attn.base_layer.out_proj` under the q/k/v parameter's wrapper)."""
    return peft.without_base_level(name)


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def summary(model: nn.Module, settings: LoraSettings, conv_rank: int | None) -> str:
    """One line: which modules got adapters, their rank and the trainable parameters."""
    unet = sum(_is_lora_layer(m) for m in model.model.modules())
    family = backbone_family(model.backbone)
    text = sum(_is_lora_layer(m) for m in model.conditioner.modules())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    where = f"{unet} UNet layers ({', '.join(settings.targets)})"
    if family is not None:
        where = f"{unet} {family.name} layers (attention and MLP)"
    where += f" + {text} text encoder layers" if text else ""
    rank = f"rank {settings.rank}" + (f", conv rank {conv_rank}" if conv_rank else "")
    kind = "DoRA" if settings.dora else "LoRA"
    return (
        f"{kind}: adapters on {where}, {rank}, alpha {settings.alpha or settings.rank}; "
        f"{trainable:,} trainable parameters ({100 * trainable / total:.2f} % of {total:,})"
    )


def add_adapters(model: nn.Module, settings: LoraSettings) -> None:
    """Freeze `model` (a LatentDiffusion) and add trainable adapters as `settings` say."""
    model.requires_grad_(False)
    common = {
        "use_dora": settings.dora,
        "init_lora_weights": INITS[settings.init],
    }
    unet = model.model  # names relative to it, as the EMA callback sees them
    family = backbone_family(model.backbone)
    if family is None:
        names = unet_targets(unet, settings.targets)
    else:  # the backbone says which layers; `targets` names the UNet's groups
        if settings.dora:
            _fail("dora", f"the {family.name} LoRA files are plain LoRA; set dora: false")
        names = [original.UNET_MODULE + n for n in family.targets(model.backbone)]
    alpha = settings.scale_alpha
    conv_rank, conv_alpha = settings.conv
    is_3x3 = {
        n: isinstance(unet.get_submodule(n), nn.Conv2d)
        and unet.get_submodule(n).kernel_size != (1, 1)
        for n in names
    }
    ranks = {n: conv_rank if is_3x3[n] else settings.rank for n in names}
    alphas = {n: conv_alpha if is_3x3[n] else alpha for n in names}
    _inject(unet, names, ranks, alphas, lora_dropout=settings.dropout, **common)
    if settings.text_encoder is not None:
        _add_text_adapters(model.conditioner, settings.text_encoder, common)
    for name, param in model.named_parameters():
        param.requires_grad_(peft.is_adapter_name(name))
        if param.requires_grad:
            param.data = param.data.float()  # adapters in fp32 whatever the base's dtype
    from ldm import lora_fast  # imports peft (and bitsandbytes): only where adapters are made

    lora_fast.use_fast_forward(model)  # plain LoRA Linear layers: one GEMM for the update
    log.info(summary(model, settings, conv_rank if any(is_3x3.values()) else None))
    # Files in the original layout (ours, original SD) load into peft's names. Registered after
    # LatentDiffusion's own hook, which accepts the text encoder's forms first.
    model.register_load_state_dict_pre_hook(
        functools.partial(_to_peft_names, list(model.state_dict()))
    )


def _add_text_adapters(encoder: nn.Module, text: TextEncoderLora, common: dict) -> None:
    """LoRA on the CLIP (SD 1.x) or OpenCLIP (SD 2.x) text encoder's attention and MLP layers,
    or on both of SDXL's (sgm's conditioner: the text embedders among its `embedders`)."""
    embedders = getattr(encoder, "embedders", None)
    if embedders is not None:
        towers = [e for e in embedders if _clip_text_model(e) or hasattr(e, "LAYERS")]
        if not towers:
            raise ValueError("model.params.lora.text_encoder: the conditioner has no text encoder")
        for tower in towers:
            _add_text_adapters(tower, text, common)
        encoder.trainable = True
        return
    alpha = text.alpha or text.rank
    clip = _clip_text_model(encoder)
    tower = getattr(encoder, "model", None)
    if clip is not None and text_targets(clip, _used_clip_layers(encoder)):
        names = text_targets(clip, _used_clip_layers(encoder))
        ranks, alphas = dict.fromkeys(names, text.rank), dict.fromkeys(names, alpha)
        _inject(clip, names, ranks, alphas, lora_dropout=text.dropout, **common)
    elif tower is not None and hasattr(tower, "transformer") and hasattr(encoder, "LAYERS"):
        if text.dropout or common["use_dora"]:
            raise ValueError(
                "model.params.lora.text_encoder: the OpenCLIP text encoder (SD 2.x) takes plain "
                "LoRA (its fused q/k/v weight has no dropout or DoRA in peft); set dropout: 0 "
                "and dora: false, or leave out text_encoder"
            )
        # The blocks the conditioning uses: SD 2.x's penultimate layer leaves the last one out
        # (as kohya's and diffusers' 23-layer CLIPTextModel of it do); SDXL's pooled output
        # reads the last block (ldm.text_encoder_xl), so there all of them.
        skipped = 0 if getattr(encoder, "always_return_pooled", False) else None
        skipped = encoder.LAYERS[encoder.layer] if skipped is None else skipped
        used = len(tower.transformer.resblocks) - skipped
        linears, fused = openclip_targets(tower, used)
        _inject(
            tower,
            linears,
            dict.fromkeys(linears, text.rank),
            dict.fromkeys(linears, alpha),
            init_lora_weights=common["init_lora_weights"],
            target_parameters=fused,
        )
    else:
        raise ValueError(
            "model.params.lora.text_encoder: supported for the CLIP (SD 1.x) and OpenCLIP "
            f"(SD 2.x) text encoders of ldm.text_encoder, not {type(encoder).__name__}"
        )
    encoder.trainable = True  # gradients flow through it (only its adapters train)


def openclip_targets(tower: nn.Module, used_blocks: int) -> tuple[list[str], list[str]]:
    """Names (in an OpenCLIP text tower) of the LoRA layers of its first `used_blocks` blocks:
    the Linear layers (attention output, MLP) and the fused q/k/v weights (`attn.in_proj_weight`,
    a parameter: peft's `target_parameters`, one LoRA of the stacked q/k/v rows)."""
    found = [re.fullmatch(OPENCLIP_LAYERS, n) for n, m in tower.named_modules()]
    linears = [f[0] for f in found if f and int(f[1]) < used_blocks]
    fused = [f"transformer.resblocks.{i}.attn.in_proj_weight" for i in range(used_blocks)]
    return linears, fused


@torch.no_grad()
def after_loading(model: nn.Module, state: Mapping) -> None:
    """After `model` loaded `state`: DoRA's magnitudes start as the norms of the base rows (the
    paper's init), so under fresh adapters (a base file: no `lora.` keys) they are computed
    again from the loaded weights."""
    if peft.has_adapters(state):
        return
    for layer in adapter_layers(model).values():
        if layer.use_dora.get(ADAPTER):
            layer.lora_magnitude_vector[ADAPTER].update_layer(
                base_layer=layer.get_base_layer(),
                lora_A=layer.lora_A[ADAPTER].weight,
                lora_B=layer.lora_B[ADAPTER].weight,
                scaling=layer.scaling[ADAPTER],
            )


def _to_peft_names(module_keys: list[str], module, state: dict, prefix: str, *args) -> None:
    peft.to_module_layout(state, [prefix + k for k in module_keys])


def _backbone_names(model: nn.Module) -> list[str]:
    return [wrappers.without_wrapper_levels(n) for n, _ in model.model.named_parameters()]


def save_layout(model: nn.Module, ckpt: dict) -> None:
    """A Lightning checkpoint's state dict (and the EMA's shadows in it) in the original layout
    with the adapters apart (`ldm.layout.peft.to_original_layout`). Sharded state dicts (FSDP's
    sharded checkpoints) keep the module's names: their loader reads them by those names."""
    state = ckpt.get("state_dict")
    if state and all(type(v) in (torch.Tensor, nn.Parameter) for v in state.values()):
        _dequantized(model, state)
        ckpt["state_dict"] = peft.to_original_layout(state, _backbone_names(model))


def _quantized_entries(model: nn.Module, state: dict) -> dict[str, list[str]]:
    """Quantized layer name -> its keys in `state` (the module's names)."""
    from ldm import quantize

    layers = quantize.quantized_layers(model)
    return {n: [k for k in state if k.startswith(n + ".")] for n in layers}


def _dequantized(model: nn.Module, state: dict) -> None:
    """A quantized base's layers in `state` as plain `weight` (and `bias`) in host RAM, one
    layer at a time: checkpoints are the same whatever the base's quantization."""
    from ldm import quantize

    for name, keys in _quantized_entries(model, state).items():
        layer = model.get_submodule(name)
        for key in keys:
            del state[key]
        state[f"{name}.weight"] = quantize.dequantize(layer).cpu()
        if getattr(layer, "bias", None) is not None:
            state[f"{name}.bias"] = layer.bias.detach().cpu()


def _requantized(model: nn.Module, state: dict) -> None:
    """Resuming onto a quantized base (quantized at fit start, before the restore): its frozen
    layers keep the model's own quantized tensors - the same base file, quantized the same way
    - in place of the checkpoint's plain copies."""
    own = model.state_dict()
    for name, keys in _quantized_entries(model, own).items():
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
        state.update({k: own[k] for k in keys})


def load_layout(model: nn.Module, ckpt: dict) -> None:
    """The inverse of `save_layout`, before Lightning and the callbacks read the state dict."""
    state = ckpt.get("state_dict")
    if state:
        keys = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
        keys = [wrappers.without_wrapper_levels(k) for k in keys]
        peft.to_module_layout(state, keys, _backbone_names(model))
        _requantized(model, state)


def _clip_text_model(encoder: nn.Module) -> nn.Module | None:
    """The transformers CLIPTextModel inside a text encoder: peft must be given the library's
    model itself (it reads its conversion rules), not a module holding it."""
    from transformers import PreTrainedModel

    holder = getattr(encoder, "transformer", None)
    found = [m for m in holder.modules() if isinstance(m, PreTrainedModel)] if holder else []
    return found[0] if found else None


def has_adapters(module: nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in module.modules())


# --- the frozen base in the training dtype -------------------------------------------------
def training_dtype(precision: str, base_dtype: str = "auto") -> torch.dtype | None:
    """The frozen weights' dtype for a trainer precision ("bf16-mixed" -> bf16), or None."""
    if base_dtype != "auto":
        return BASE_DTYPES[base_dtype]
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def _input_to_weight_dtype(module, args):
    module.input_dtype = args[0].dtype  # for the way out (the forward hook sees the cast input)
    return (args[0].to(module.weight.dtype), *args[1:])


def _output_to_input_dtype(module, args, output):
    # Under autocast the next op casts as it likes; without it (e.g. sampling outside the
    # training step) the activations keep their dtype, so fp32 layers after this one work.
    if torch.is_autocast_enabled(output.device.type):
        return output
    return output.to(module.input_dtype)


def hold_frozen_in(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast the frozen Linear / Conv2d layers of `module` to `dtype` (halves the base's memory
    under bf16/fp16 training); their inputs are cast on the way in and back on the way out.
    Norms stay float32 (small, and precision-sensitive). Returns the number of layers cast."""
    from ldm.quantize import is_quantized

    count = 0
    for layer in module.modules():
        if not _lora_able(layer) or any(p.requires_grad for p in layer.parameters()):
            continue
        if is_quantized(layer):  # bitsandbytes' Linear8bitLt is an nn.Linear: its own dtypes
            continue
        if layer.weight.dtype == dtype:
            continue
        layer.to(dtype)
        layer.register_forward_pre_hook(_input_to_weight_dtype)
        layer.register_forward_hook(_output_to_input_dtype, with_kwargs=False)
        count += 1
    return count


# --- adapters as files ---------------------------------------------------------------------
def is_sdxl(model: nn.Module) -> bool:
    """An SDXL LatentDiffusion (sgm's conditioner of embedders): kohya names it the SDXL way."""
    return hasattr(model.conditioner, "embedders")


def res_blocks_of(unet: nn.Module) -> int:
    """`num_res_blocks` of a built UNetModel: the up path has num_res_blocks + 1 per level."""
    from ldm.unet import Downsample

    levels = 1 + sum(isinstance(m, Downsample) for m in unet.modules())
    return len(unet.output_blocks) // levels - 1


def adapter_layers(model: nn.Module, adapter: str = ADAPTER) -> dict[str, nn.Module]:
    """The LoRA layers of `model` by their original module name (`model.diffusion_model...`)."""
    return {
        layer_name(name): layer
        for name, layer in model.named_modules()
        if _is_lora_layer(layer) and adapter in layer.lora_A
    }


def _exported_parts(name: str, layer, adapter: str):
    """(module name, lora_A, lora_B) of a layer as kohya / diffusers files hold it. OpenCLIP's
    fused q/k/v LoRA (W_qkv + B A, B stacked q/k/v rows) is three LoRAs of the split q/k/v
    weights that share A: exactly the layers of the HF CLIP model that kohya and diffusers
    convert SD 2.x's text encoder to."""
    down, up = layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach()
    if not _is_fused_qkv(layer):
        return [(name, down, up)]
    parts = zip("qkv", up.chunk(3))  # copies: a file holds each tensor on its own
    return [(f"{name}.in_proj.{part}", down.clone(), rows.clone()) for part, rows in parts]


def _is_fused_qkv(layer) -> bool:
    return getattr(layer, "parameter_name", None) == "in_proj_weight"


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W||_2 of each output row, shaped (out, 1, ...) like W's dims."""
    return weight.reshape(weight.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))


def _dora_scale(layer, adapter: str) -> torch.Tensor | None:
    """DoRA's magnitude as the kohya-format loaders (ComfyUI, Forge) apply an output-axis
    `dora_scale` (shape (out, 1) / (out, 1, 1, 1)): W' = (W + dW) * dora_scale / ||W||, the norm
    of the *base* rows - where peft and the DoRA paper divide by ||W + dW||. Written as
    m * ||W|| / ||W + dW||, so those loaders give exactly peft's W' = m (W + dW) / ||W + dW||."""
    if not layer.use_dora.get(adapter):
        return None
    weight = layer.get_base_layer().weight.detach().float()
    delta = layer.get_delta_weight(adapter).detach().float().reshape(weight.shape)
    magnitude = layer.lora_magnitude_vector[adapter].weight.detach().float()
    magnitude = magnitude.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    return magnitude * _row_norms(weight) / _row_norms(weight + delta)


def _magnitude_of(layer, adapter: str, dora_scale: torch.Tensor, source: str) -> torch.Tensor:
    """The inverse of `_dora_scale`: peft's magnitude for a file's output-axis `dora_scale`."""
    weight = layer.get_base_layer().weight.detach().float()
    if dora_scale.shape[0] != weight.shape[0] or dora_scale.numel() != weight.shape[0]:
        raise ValueError(
            f"{source}: dora_scale of shape {tuple(dora_scale.shape)} is on the input axis "
            "(LyCORIS wd_on_out=False); only output-axis DoRA files are supported"
        )
    delta = layer.get_delta_weight(adapter).detach().float().reshape(weight.shape)
    magnitude = dora_scale.float().reshape(_row_norms(weight).shape)
    return magnitude * _row_norms(weight + delta) / _row_norms(weight)


def kohya_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters of a LatentDiffusion as a kohya LoRA state dict: per layer
    `<name>.lora_down.weight` (A), `.lora_up.weight` (B), `.alpha` (0-dim) and, for DoRA,
    `.dora_scale`; kohya applies up @ down * alpha / rank, as peft does."""
    family = backbone_family(model.backbone)
    if family is not None:
        return family.layout.to_kohya(family.layout.peft_adapters(model), dtype)
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    state = {}
    for name, layer in adapter_layers(model).items():
        for part, down, up in _exported_parts(name, layer, ADAPTER):
            kohya = lora_kohya.kohya_name(part, res_blocks, sdxl)
            state[f"{kohya}.lora_down.weight"] = down
            state[f"{kohya}.lora_up.weight"] = up
            state[f"{kohya}.alpha"] = torch.tensor(float(layer.lora_alpha[ADAPTER]))
        scale = _dora_scale(layer, ADAPTER)
        if scale is not None:
            state[f"{kohya}.dora_scale"] = scale
    return {k: v.to(dtype or v.dtype).contiguous() for k, v in state.items()}


def diffusers_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in the diffusers/peft format `pipeline.load_lora_weights` reads natively:
    `unet.<diffusers path>.lora_A.weight` / `.lora_B.weight` (and `text_encoder.`). The
    scale alpha / rank is folded into lora_B, so the file needs no alpha (diffusers takes 1).
    SD3 and Flux: `transformer.<diffusers path>...`, fused q/k/v split (ldm.layout.kohya_*)."""
    family = backbone_family(model.backbone)
    if family is not None:
        return family.layout.to_diffusers(family.layout.peft_adapters(model))
    res_blocks = res_blocks_of(model.backbone)
    state = {}
    for name, layer in adapter_layers(model).items():
        scaling = layer.lora_alpha[ADAPTER] / layer.r[ADAPTER]
        for part, down, up in _exported_parts(name, layer, ADAPTER):
            component, path = lora_kohya.module_path(part, res_blocks)
            key = f"{component}.{path}"
            state[f"{key}.lora_A.weight"] = down.float()
            state[f"{key}.lora_B.weight"] = up.float() * scaling
        if layer.use_dora.get(ADAPTER):
            # peft's own shape: (out,) for Linear, (1, out, 1, 1) for Conv2d
            state[f"{key}.lora_magnitude_vector.weight"] = (
                layer.lora_magnitude_vector[ADAPTER].weight.detach().float()
            )
    return {k: v.cpu().contiguous() for k, v in state.items()}


# --- merging -------------------------------------------------------------------------------
def _unload(model: nn.Module) -> None:
    """Replace every peft layer by its base layer (after merging, or to drop the adapters)."""
    for name, layer in reversed(list(model.named_modules())):  # inner layers first
        if _is_lora_layer(layer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    for module in model.modules():  # peft's record of the adapters it added, now gone
        if hasattr(module, "peft_config"):
            del module.peft_config


@torch.no_grad()
def merge_adapters(model: nn.Module, weight: float = 1.0, adapter: str = ADAPTER) -> int:
    """Fold `adapter` into the base weights and remove every peft layer; returns the number of
    layers merged. The model is then a plain original one. At `weight` w the merged weight is
    W + w (W1 - W), W1 being peft's merge at full strength: for LoRA that is W + w s B A, and
    for DoRA it is how kohya-format loaders apply a strength (ComfyUI's weight_decompose)."""
    layers = adapter_layers(model, adapter)
    for layer in layers.values():
        # the wrapped weight: a layer's `weight`, or a wrapped parameter (OpenCLIP's in_proj)
        base = getattr(layer.get_base_layer(), getattr(layer, "parameter_name", "weight"))
        before = base.detach().clone() if weight != 1.0 else None
        layer.merge(safe_merge=True, adapter_names=[adapter])
        if before is not None:
            base.data = torch.lerp(before, base.detach(), weight)
    _unload(model)
    return len(layers)


def kohya_modules(model: nn.Module) -> dict[str, str]:
    """kohya LoRA name -> module name in `model` (a LatentDiffusion without adapters), for every
    UNet and CLIP text-encoder Linear / Conv2d that has a kohya name (each of its names)."""
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    found = {}
    for name, module in model.named_modules():
        if _lora_able(module):
            try:
                found.update(dict.fromkeys(lora_kohya.kohya_names(name, res_blocks, sdxl), name))
            except ValueError:
                continue
    return found


@torch.no_grad()
def merge_kohya(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    weight: float = 1.0,
    source: str = "LoRA file",
    magnitudes: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Merge a kohya LoRA state dict (ours or any trainer's) into `model`'s base weights at
    `weight`, through peft's layers; returns the number of layers changed. Adapters already in
    the model must be merged first (`merge_adapters`). `magnitudes`: DoRA magnitudes by kohya
    name in peft's own form (diffusers-format files), instead of kohya's `dora_scale`."""
    magnitudes = magnitudes or {}
    if has_adapters(model):
        raise ValueError("merge the model's own adapters first (merge_adapters)")
    family = backbone_family(model.backbone)
    if family is not None:
        return _merge_family(model, family, state, weight)
    modules = kohya_modules(model)
    downs = sorted(
        k.removesuffix(".lora_down.weight") for k in state if k.endswith(".lora_down.weight")
    )
    if not downs:
        raise ValueError(f"{source}: no kohya LoRA weights (<name>.lora_down.weight) in it")
    fused = _merge_split_qkv(model, state, downs, weight, source)
    downs = [k for k in downs if k not in fused]
    if not downs:
        return len(fused)
    unknown = [k for k in downs if k not in modules]
    if unknown:
        raise ValueError(
            f"{source}: {len(unknown)} LoRA modules do not exist in this model, e.g. {unknown[0]} "
            "(a LoRA for another model family?)"
        )
    names = [modules[k] for k in downs]
    ranks = {modules[k]: state[k + ".lora_down.weight"].shape[0] for k in downs}
    alphas = {
        modules[k]: float(state[k + ".alpha"])
        if k + ".alpha" in state
        else float(ranks[modules[k]])
        for k in downs
    }
    dora = any(k + ".dora_scale" in state or k in magnitudes for k in downs)
    adapter = "merge"
    _inject(model, names, ranks, alphas, use_dora=dora, init_lora_weights=False, adapter=adapter)
    for kohya, name in zip(downs, names):
        layer = model.get_submodule(name)
        layer.lora_A[adapter].weight.copy_(state[kohya + ".lora_down.weight"])
        layer.lora_B[adapter].weight.copy_(state[kohya + ".lora_up.weight"])
        if dora:
            magnitude = layer.lora_magnitude_vector[adapter].weight
            found = magnitudes.get(kohya)
            if found is None:
                found = _magnitude_of(layer, adapter, state[kohya + ".dora_scale"], source)
            magnitude.copy_(found.reshape(magnitude.shape))
    return merge_adapters(model, weight, adapter) + len(fused)


def _merge_family(model: nn.Module, family: Family, state, weight: float) -> int:
    """`merge_kohya` for a backbone that owns its LoRA rules (SD3, Flux): its layout reads the
    file into {module: (down, up, alpha)}, merged through peft's layers as for the UNet."""
    linears = [n for n, m in model.backbone.named_modules() if isinstance(m, nn.Linear)]
    adapters = family.layout.from_kohya(state, linears)
    names = {original.unet_key(m): v for m, v in adapters.items()}
    ranks = {n: down.shape[0] for n, (down, _, _) in names.items()}
    alphas = {n: alpha for n, (_, _, alpha) in names.items()}
    adapter = "merge"
    _inject(model, list(names), ranks, alphas, init_lora_weights=False, adapter=adapter)
    for name, (down, up, _) in names.items():
        layer = model.get_submodule(name)
        layer.lora_A[adapter].weight.copy_(down)
        layer.lora_B[adapter].weight.copy_(up)
    return merge_adapters(model, weight, adapter)


def _merge_split_qkv(model, state, downs: list[str], weight: float, source: str) -> set[str]:
    """The q/k/v LoRAs of an OpenCLIP text encoder (SD 2.x; kohya / diffusers name its split
    q_proj/k_proj/v_proj) added to their rows of the fused `in_proj_weight` by kohya's rule,
    W += weight * alpha / rank * up @ down (no peft layer holds a third of a weight); returns
    the kohya names merged."""
    res_blocks, sdxl = res_blocks_of(model.backbone), is_sdxl(model)
    rows = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "in_proj_weight", None), nn.Parameter):
            for index, part in enumerate("qkv"):
                try:
                    rows[lora_kohya.kohya_name(f"{name}.in_proj.{part}", res_blocks, sdxl)] = (
                        module,
                        index,
                    )
                except ValueError:
                    continue
    merged = {k for k in downs if k in rows}
    for kohya in merged:
        if kohya + ".dora_scale" in state:
            raise ValueError(f"{source}: {kohya}: DoRA on the split q/k/v is not supported")
        down, up = state[kohya + ".lora_down.weight"], state[kohya + ".lora_up.weight"]
        alpha = float(state[kohya + ".alpha"]) if kohya + ".alpha" in state else down.shape[0]
        module, index = rows[kohya]
        fused = module.in_proj_weight
        width = fused.shape[0] // 3
        delta = (up.float() @ down.float()) * (weight * alpha / down.shape[0])
        fused.data[index * width : (index + 1) * width] += delta.to(fused)
    return merged


def merge_file(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    weight: float = 1.0,
    source: str = "LoRA file",
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Merge a LoRA file's state dict, kohya or diffusers format (its safetensors `metadata`
    may hold diffusers' alphas), into `model` at `weight` (`merge_kohya`)."""
    family = backbone_family(model.backbone)
    if family is not None and not any(k.endswith(".lora_down.weight") for k in state):
        raise ValueError(
            f"{source}: only kohya-format {family.name} LoRA files (<name>.lora_down.weight) "
            "merge here; load a diffusers-format one with diffusers' load_lora_weights"
        )
    if lora_kohya.is_diffusers_format(state):
        state, magnitudes = lora_kohya.from_diffusers(state, metadata, is_sdxl(model))
        return merge_kohya(model, state, weight, source, magnitudes)
    return merge_kohya(model, state, weight, source)


def hold_base_for_training(model: nn.Module, trainer) -> None:
    """At fit start: the frozen weights of the backbone in the training dtype (`base_dtype`)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    settings = model.lora_settings
    if settings.base_dtype == "auto" and isinstance(
        trainer.strategy, (FSDPStrategy, DeepSpeedStrategy)
    ):
        return  # they flatten / cast the parameters themselves
    dtype = training_dtype(trainer.precision, settings.base_dtype)
    quantize_base(model, settings.base_quantization, dtype or torch.float32, trainer)
    if dtype is not None and dtype != torch.float32:
        hold_frozen_in(model.model, dtype)
    if settings.blocks_to_swap:
        from ldm.block_swap import swap_blocks

        swap_blocks(model.model, settings.blocks_to_swap, trainer.strategy.root_device)


def quantize_base(model: nn.Module, kind: str, compute_dtype: torch.dtype, trainer=None) -> int:
    """The frozen backbone quantized as `base_quantization` says (once: `lun.memory_quant`
    may have done it before the plan; "auto" is resolved there, else it means none)."""
    from ldm import quantize

    if kind in ("none", "auto") or quantize.is_quantized(model.model):
        return 0
    device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
    why = quantize.unsupported(kind, device)
    if why:
        _fail("base_quantization", why)
    return quantize_blocks(model.model, kind, compute_dtype)


def quantize_blocks(backbone: nn.Module, kind: str, compute_dtype: torch.dtype) -> int:
    """The frozen layers of the backbone's blocks quantized (nearly all of its weights); the
    embedders and the output layer, small and read for their dtype, stay as they are (as
    musubi-tuner and ai-toolkit keep them)."""
    from ldm import quantize
    from ldm.block_swap import blocks_of

    return sum(quantize.quantize_frozen(b, kind, compute_dtype) for b in blocks_of(backbone))
