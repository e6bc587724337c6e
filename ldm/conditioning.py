"""Conditioning: a batch -> a dict of named tensors for the backbone, and its unconditional side.

The fields every backbone reads (`forward(x, t, cond)`):
    crossattn: (B, T, D) text context for cross-attention (Rombach et al. 2022);
    vector:    (B, D) pooled text and size/crop embeddings (SDXL's `adm` input, Podell et al. 2023);
    y:         (B,) int64 class ids; the id `num_classes` is the null class (DiT, Peebles & Xie 2023).

The conditioner is the one owner of dropout for classifier-free guidance (Ho & Salimans 2022,
arXiv:2207.12598): while training, each input is replaced by its unconditional value with
probability `ucg_rate` - the empty caption for text, the null class for labels. Sampling asks the
same conditioner for the other half of the guidance (`unconditional`), so training and guidance
agree on what "unconditional" means.

An `Embedder` turns one batch key into one field. A single embedder is a whole conditioner: SD 1.x
and 2.x use their text encoder directly (`cond_stage_model.*` in checkpoints), which keeps the
original layout with no renaming.
"""

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

FIELDS = ("crossattn", "vector", "y")


@runtime_checkable
class Conditioner(Protocol):
    """What `LatentDiffusion` uses of its conditioner."""

    trainable: bool

    def condition(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]: ...

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]: ...

    def batch_of(self, inputs) -> dict: ...

    def lora_targets(self) -> list:
        """The text layers adapters may go on (`ldm.adapters.AdapterTargets`, one per tower);
        [] when there are none (a class-label or frozen-only conditioner)."""
        ...

    @property
    def field_widths(self) -> dict[str, int]:
        """The width of each field it makes (`crossattn`, `vector`; for `y` the class count),
        from its built parts' configs: `check_field_widths` compares them with the backbone's."""
        ...


class Embedder(nn.Module):
    """One conditioning input: `batch[input_key]` -> the field `field` of the conditioning dict.

    Subclasses set `input_key` and `field` and implement `forward(inputs)` and `null_inputs(n)`.

    Args:
        ucg_rate: probability of training on the unconditional input instead of the real one
            (classifier-free guidance); 0.1 is common.
        trainable: train this embedder with the backbone (otherwise frozen: no gradients, eval
            mode, no optimizer state).
    """

    input_key: str = ""
    field: str = ""

    def __init__(self, ucg_rate: float = 0.0, trainable: bool = False):
        super().__init__()
        if not 0.0 <= ucg_rate <= 1.0:
            raise ValueError(f"ucg_rate must be in [0, 1], got {ucg_rate}")
        self.ucg_rate, self.trainable = float(ucg_rate), trainable
        self._null_output = None  # the frozen embedder's output for the null input (cached runs)
        self.register_load_state_dict_post_hook(_forget_null_output)

    def null_inputs(self, n: int):
        """The unconditional value of `n` inputs."""
        raise NotImplementedError

    @property
    def field_widths(self) -> dict[str, int]:
        """`{field: width}` of its output (subclasses give `width`, read from their config)."""
        return {self.field: self.width}

    def freeze(self) -> None:
        """No gradients and eval mode (the original encoders' `freeze`)."""
        self.trainable = False
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):
        # A frozen embedder stays in eval mode (no dropout) while the model around it trains.
        return super().train(mode and self.trainable)

    def lora_targets(self) -> list:
        """No layers for adapters (class labels, T5); the CLIP towers say theirs."""
        return []

    def batch_of(self, inputs) -> dict:
        """Inputs given alone (prompts, labels) as the batch this conditioner reads."""
        return dict(inputs) if isinstance(inputs, Mapping) else {self.input_key: inputs}

    def condition(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]:
        """`{field: embedding}` of `batch[input_key]`; with `drop`, each input is replaced by its
        unconditional value with probability `ucg_rate` (draws from `generator`, else the global
        CPU generator)."""
        inputs = batch[self.input_key]
        # Outputs cached by scripts/cache_latents.py stand in for a frozen embedder's forward.
        cached = None if self.trainable else (batch.get("context") or {}).get(self.field)
        if drop and self.ucg_rate > 0:
            device = generator.device if generator is not None else "cpu"
            dropped = torch.rand(len(inputs), generator=generator, device=device) < self.ucg_rate
            if cached is not None:
                return {self.field: self._drop_cached(cached, dropped)}
            inputs = _replace(inputs, self.null_inputs(len(inputs)), dropped)
        return {self.field: cached if cached is not None else self._embed(inputs)}

    def _drop_cached(self, cached: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """Cached outputs with the dropped rows replaced by the null input's output, computed
        once (the embedder is frozen) and forgotten when weights are loaded."""
        if not dropped.any():
            return cached
        null = getattr(self, "_null_output", None)
        if null is None or null.device != cached.device or null.dtype != cached.dtype:
            null = self._null_output = self._embed(self.null_inputs(1)).to(cached)
        where = dropped.to(cached.device).view(-1, *[1] * (cached.dim() - 1))
        return torch.where(where, null, cached)

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]:
        """The guidance's unconditional side for `batch`: the null inputs, or `negative` (e.g.
        negative prompts, one per sample)."""
        n = len(batch[self.input_key])
        return {self.field: self._embed(self.null_inputs(n) if negative is None else negative)}

    def _embed(self, inputs) -> torch.Tensor:
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            return self(inputs)


def _forget_null_output(module, incompatible_keys) -> None:
    module._null_output = None


def _replace(inputs, nulls, dropped: torch.Tensor):
    """`inputs` with the entries where `dropped` is True replaced by `nulls`."""
    if isinstance(inputs, torch.Tensor):
        return torch.where(dropped.to(inputs.device), nulls.to(inputs.device), inputs)
    return [n if d else x for x, n, d in zip(inputs, nulls, dropped.tolist())]


class TextEmbedder(Embedder):
    """Base of the text encoders: captions (`batch["caption"]`) -> `crossattn`; the unconditional
    caption is the empty one, as in Stable Diffusion's training and sampling."""

    input_key, field = "caption", "crossattn"

    def null_inputs(self, n: int) -> list[str]:
        return [""] * n


class ClassLabels(Embedder):
    """Class ids (`batch["label"]`) -> `y`, for backbones that embed them (DiT's `y_embedder`,
    a UNet's `label_emb`). The null class `num_classes` is the unconditional label: the backbone's
    table has `num_classes + 1` rows for it (DiT's `LabelEmbedder` with dropout > 0).

    Args:
        num_classes: number of real classes; labels must be in [0, num_classes).
        ucg_rate: probability of training on the null class (DiT: 0.1).
    """

    input_key, field = "label", "y"

    def __init__(self, num_classes: int, ucg_rate: float = 0.0):
        super().__init__(ucg_rate=ucg_rate, trainable=False)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes = num_classes

    def null_inputs(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.num_classes, dtype=torch.long)

    @property
    def field_widths(self) -> dict[str, int]:
        return {"y": self.num_classes}  # a label's "width": the class count the ids run over

    def forward(self, labels: Sequence[int] | torch.Tensor) -> torch.Tensor:
        labels = torch.as_tensor(labels, dtype=torch.long)
        if labels.numel() and (labels.min() < 0 or labels.max() > self.num_classes):
            raise ValueError(
                f"class labels must be in [0, {self.num_classes}] ({self.num_classes} = the null "
                f"class), got {labels.min().item()}..{labels.max().item()}"
            )
        return labels  # (B,)


# --- the conditioner and the backbone agree on widths -------------------------------------------
# What each field is, for the error line.
FIELD_MEANINGS = {"crossattn": "text tokens", "vector": "pooled vector", "y": "class labels"}


def _named(field: str) -> str:
    return f"{field} ({FIELD_MEANINGS.get(field, 'a conditioning field')})"


def _amount(field: str, width: int) -> str:
    return f"{width} classes" if field == "y" else f"{width} wide"


def check_field_widths(conditioner: nn.Module, backbone: nn.Module) -> None:
    """ValueError, one line, when the conditioner does not make each field the backbone reads at
    the width it reads it (or more class ids than its table has, or a field it does not read):
    checked when the model is built, from the parts' configs (nothing runs), instead of a shape
    error at the first training step.

    Both parts say their widths (`field_widths`); the backbone also names the config key that
    sets each (`field_keys`), which the line starts with (the launcher finds its full path). A
    part that does not say (a user's own class) is not checked."""
    made = getattr(conditioner, "field_widths", None)
    read = getattr(backbone, "field_widths", None)
    if made is None or read is None:
        return
    maker = f"conditioner_config ({type(conditioner).__name__})"
    reader = type(backbone).__name__
    keys = getattr(backbone, "field_keys", {})
    for field, want in read.items():  # first what the backbone cannot do without
        have, key, what = made.get(field), keys.get(field, field), _named(field)
        if have is None:
            raise ValueError(
                f"{key}={want}: {reader} reads {what}, which {maker} does not make (it makes "
                f"{', '.join(made) or 'nothing'}); use a conditioner that makes {field}, or a "
                "backbone that reads what this one makes"
            )
        # Class ids index the backbone's table: fewer classes fit (a 1000-class DiT tuned on
        # a subset), more would index past it.
        mismatched = have > want if field == "y" else have != want
        if mismatched:
            raise ValueError(
                f"{key}={want}: {reader} reads {what} {_amount(field, want)}, but {maker} makes "
                f"{_amount(field, have)}; set {key}: {have}, or configure the conditioner to "
                f"make {_amount(field, want)}"
            )
    for field, have in made.items():  # then what would be dropped without a word
        if field not in read:
            fix = (
                f"set the backbone's {keys[field]}: {have}"
                if field in keys
                else "use a backbone that reads it"
            )
            raise ValueError(
                f"{maker} makes {_named(field)} {_amount(field, have)}, which {reader} does "
                f"not read; {fix}, or use a conditioner without it"
            )
