"""`model.params.lora`: what a LoRA run asks for (`LoraSettings`), checked before anything is
built; a bad value is one ValueError naming its key."""

import dataclasses
from collections.abc import Mapping

import torch

from ldm.lora.targets import UNET_GROUPS

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
        device ahead of use (`ldm.block_swap`); 0: none; "auto": the fewest that make the memory
        plan fit the device (`lun.memory_quant`, run by main.py before the run folder). A fit
        that meets an unresolved "auto" (a Trainer without main.py's plan) swaps none
        (`swapped_blocks`), as an unresolved `base_quantization: auto` quantizes nothing.
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
    blocks_to_swap: int | str = 0

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

    @property
    def swapped_blocks(self) -> int:
        """The blocks to swap as a number: an unresolved "auto" (no plan ran) is 0."""
        return 0 if self.blocks_to_swap == "auto" else self.blocks_to_swap


def fail(key: str, why: str):
    raise ValueError(f"model.params.lora.{key}: {why}")


def _check_rank_alpha(prefix: str, values: Mapping) -> None:
    rank = values.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        fail(prefix + "rank", f"must be a positive integer, got {rank!r}")
    alpha = values.get("alpha")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0
    ):
        fail(prefix + "alpha", f"must be a positive number, got {alpha!r}")
    dropout = values.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        fail(prefix + "dropout", f"must be in [0, 1), got {dropout!r}")


def parse_settings(config: Mapping | None) -> LoraSettings | None:
    """`model.params.lora` -> LoraSettings (None: no LoRA); ValueError naming the bad key."""
    if config is None or config is False:
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"model.params.lora: must be a mapping, got {config!r}")
    fields = {f.name for f in dataclasses.fields(LoraSettings)}
    for key in config:
        if key not in fields:
            fail(key, f"unknown key; known: {', '.join(sorted(fields))}")
    values = dict(config)
    _check_rank_alpha("", values)
    _check_rank_alpha("conv_", {"rank": values.get("conv_rank"), "alpha": values.get("conv_alpha")})
    targets = values.get("targets", LoraSettings.targets)
    if isinstance(targets, str) or not targets or any(t not in UNET_GROUPS for t in targets):
        fail("targets", f"must be a list of {', '.join(UNET_GROUPS)}, got {targets!r}")
    values["targets"] = tuple(targets)
    if not isinstance(values.get("dora", False), bool):
        fail("dora", f"must be true or false, got {values['dora']!r}")
    if values.get("init", "default") not in INITS:
        fail("init", f"must be one of {', '.join(INITS)}, got {values['init']!r}")
    if values.get("base_dtype", "auto") not in BASE_DTYPES:
        fail("base_dtype", f"must be one of {', '.join(BASE_DTYPES)}, got {values['base_dtype']!r}")
    _check_quantization(values)
    text = values.get("text_encoder")
    if text is not None:
        if not isinstance(text, Mapping):
            fail("text_encoder", f"must be a mapping {{rank, alpha, dropout, lr}}, got {text!r}")
        known = {f.name for f in dataclasses.fields(TextEncoderLora)}
        for key in text:
            if key not in known:
                fail(f"text_encoder.{key}", f"unknown key; known: {', '.join(sorted(known))}")
        _check_rank_alpha("text_encoder.", text)
        lr = text.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0):
            fail("text_encoder.lr", f"must be a positive number, got {lr!r}")
        values["text_encoder"] = TextEncoderLora(**text)
    return LoraSettings(**values)


def _check_quantization(values: Mapping) -> None:
    from ldm.quantize import KINDS

    kind = values.get("base_quantization", "none")
    if kind not in KINDS:
        fail("base_quantization", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "none" and values.get("dora", False):
        fail(
            "base_quantization",
            "DoRA reads the base weights' row norms; use a full-precision base (none) or dora: false",
        )
    swap = values.get("blocks_to_swap", 0)
    if swap != "auto" and (isinstance(swap, bool) or not isinstance(swap, int) or swap < 0):
        fail("blocks_to_swap", f"must be a whole number >= 0 or auto, got {swap!r}")
