"""Adapters made: peft's LoRA / LoCon / DoRA layers on the layers `ldm.lora.targets` names, the
rest of the model frozen."""

import functools
import logging
import re
from collections.abc import Mapping

import torch
from torch import nn

from ldm.layout import original, peft
from ldm.lora.settings import INITS, LoraSettings, TextEncoderLora, fail
from ldm.lora.targets import (
    ADAPTER,
    adapter_layers,
    backbone_family,
    is_lora_layer,
    layer_name,
    unet_targets,
)

log = logging.getLogger("ldm.lora")  # the name users' logging configs (and the tests) know


def inject(
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
    made = {layer_name(n) for n, m in module.named_modules() if is_lora_layer(m)}
    asked = {*names, *(p.rpartition(".")[0] for p in kwargs.get("target_parameters", ()))}
    if made != asked:  # peft matches names by suffix: check that it took exactly these
        raise RuntimeError(f"peft adapted {len(made)} layers, asked for {len(asked)}")


def summary(model: nn.Module, settings: LoraSettings, conv_rank: int | None) -> str:
    """One line: which modules got adapters, their rank and the trainable parameters."""
    unet = sum(is_lora_layer(m) for m in model.model.modules())
    family = backbone_family(model.backbone)
    text = sum(is_lora_layer(m) for m in model.conditioner.modules())
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
            fail("dora", f"the {family.name} LoRA files are plain LoRA; set dora: false")
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
    inject(unet, names, ranks, alphas, lora_dropout=settings.dropout, **common)
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


def _add_text_adapters(conditioner: nn.Module, text: TextEncoderLora, common: dict) -> None:
    """LoRA on the layers the conditioner's text towers name (their `lora_targets()`: CLIP's
    and OpenCLIP's attention and MLP layers, SDXL's two towers); the towers then run with
    gradients (only their adapters train)."""
    targets = [t for t in conditioner.lora_targets() if t.layers]
    if not targets:
        fail(
            "text_encoder",
            "supported for the CLIP (SD 1.x), OpenCLIP (SD 2.x) and SDXL text encoders, not "
            f"{type(conditioner).__name__}; leave out text_encoder",
        )
    alpha = text.alpha or text.rank
    for target in targets:
        kwargs = {"lora_dropout": text.dropout, **common}
        if target.plain_only:
            if text.dropout or common["use_dora"]:
                fail(
                    "text_encoder",
                    f"{target.plain_only}; set dropout: 0 and dora: false, or leave out "
                    "text_encoder",
                )
            kwargs = {"init_lora_weights": common["init_lora_weights"]}
        if target.parameters:
            kwargs["target_parameters"] = target.parameters
        ranks = dict.fromkeys(target.layers, text.rank)
        inject(target.module, target.layers, ranks, dict.fromkeys(target.layers, alpha), **kwargs)
        target.tower.trainable = True  # gradients flow through it
    conditioner.trainable = True


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
