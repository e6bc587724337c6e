"""SDXL's conditioner: several embedders, their outputs joined by shape (sgm's GeneralConditioner).

Podell et al. 2023 (arXiv:2307.01952): two text encoders make the cross-attention context and
the pooled text embedding; the image's original size, its crop offsets (top, left) and the target
size are each Fourier-embedded (sec. 2.2, "micro-conditioning") and joined with the pooled text
into the `vector` field (1280 + 3 x 2 x 256 = 2816 channels). Outputs are combined as sgm does:
2-d outputs (B, D) are concatenated into `vector`, 3-d ones (B, T, D) into `crossattn`, in the
order of the embedders. The checkpoint names are sgm's: `conditioner.embedders.N.*`.

Batch keys read: `caption` (sgm's `txt`), and `original_size_as_tuple` (B, 2) = (height, width)
of the image before resizing, `crop_coords_top_left` (B, 2) = (top, left), `target_size_as_tuple`
(B, 2). A missing target size is the batch's image size (`image`, or `image_size` (H, W) that
sampling sets); a missing original size is the target size, a missing crop (0, 0) - what
diffusers' StableDiffusionXLPipeline uses by default.

Classifier-free guidance: the conditioner is its one owner. Each input key is dropped at most
once per sample - with the largest `ucg_rate` of the embedders that read it - and then for all of
them, so a dropped caption drops both text encoders' features together. A dropped embedding is
zeros (sgm's rule; the unconditional side of SDXL sampling is zeros too, diffusers'
`force_zeros_for_empty_prompt`), or the embedding of `legacy_ucg_value` when an embedder sets one.
"""

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ldm.unet import timestep_embedding
from ldm.util import instantiate_from_config

CAPTION_KEY = "caption"
INPUT_KEY_ALIASES = {"txt": CAPTION_KEY}  # sgm's batch key for captions -> ours
SIZE_KEYS = ("original_size_as_tuple", "crop_coords_top_left", "target_size_as_tuple")
FIELD_BY_NDIM = {2: "vector", 3: "crossattn"}


class ConcatTimestepEmbedderND(nn.Module):
    """Each of the N numbers of an input (B, N) -> a sinusoidal embedding of `outdim` channels,
    concatenated: (B, N * outdim). sgm's size / crop embedder; no parameters.

    Args:
        outdim: channels per number (SDXL: 256).
    """

    input_key = ""  # set by GeneralConditioner

    def __init__(self, outdim: int):
        super().__init__()
        self.outdim = outdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        emb = timestep_embedding(x.reshape(-1), self.outdim)  # (B * N, outdim)
        return emb.reshape(b, -1)  # (B, N * outdim)

    @property
    def field_widths(self) -> dict[str, int]:
        # SDXL's size and crop inputs are (height, width)-like pairs (`pairs`); sgm's other
        # input of this kind, the refiner's aesthetic_score, is one number (B, 1).
        numbers = 2 if self.input_key in SIZE_KEYS else 1
        return {"vector": numbers * self.outdim}

    def lora_targets(self) -> list:
        return []  # no parameters


class GeneralConditioner(nn.Module):
    """sgm's `GeneralConditioner`: a list of embedders, each reading one batch key.

    Args:
        emb_models: one entry per embedder: `{target, params, input_key, is_trainable,
            ucg_rate, legacy_ucg_value}` (sgm's form; sgm targets map through ldm.util).
        ucg_rate: if set, the caption dropout rate of every embedder reading the caption
            (the original configs' `model.params.ucg_rate` lands here).
        freeze: if set, overrides every embedder's `is_trainable` (False = train them all).
        force_zeros_for_empty_prompt: the unconditional side without negative prompts is zeros
            (SDXL, as sgm and diffusers sample it); False: the embedding of "".
    """

    checkpoint_name = "conditioner"  # keys conditioner.embedders.N.* (ldm.checkpoint)
    input_key = CAPTION_KEY

    def __init__(
        self,
        emb_models: Sequence[Mapping],
        ucg_rate: float | None = None,
        freeze: bool | None = None,
        force_zeros_for_empty_prompt: bool = True,
    ):
        super().__init__()
        self.embedders = nn.ModuleList()
        for i, spec in enumerate(emb_models):
            spec = dict(spec)
            if "input_key" not in spec:
                raise ValueError(f"conditioner_config.params.emb_models.{i}: no input_key")
            if "input_keys" in spec:
                raise ValueError(
                    f"conditioner_config.params.emb_models.{i}: input_keys unsupported"
                )
            key = INPUT_KEY_ALIASES.get(spec["input_key"], spec["input_key"])
            trainable = bool(spec.get("is_trainable", False)) if freeze is None else not freeze
            rate = float(spec.get("ucg_rate", 0.0))
            if ucg_rate is not None and key == CAPTION_KEY:
                rate = float(ucg_rate)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"conditioner_config.params.emb_models.{i}.ucg_rate: {rate}")
            embedder = instantiate_from_config(spec)
            # The embedder's own settings (ldm.conditioning.Embedder) give way to the entry's.
            embedder.input_key, embedder.ucg_rate, embedder.trainable = key, 0.0, trainable
            embedder.drop_rate = rate
            embedder.legacy_ucg_value = spec.get("legacy_ucg_value")
            embedder.requires_grad_(trainable)
            self.embedders.append(embedder)
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self.trainable = any(e.trainable for e in self.embedders)

    def train(self, mode: bool = True):
        super().train(mode)
        for embedder in self.embedders:  # a frozen embedder stays in eval mode
            embedder.train(mode and embedder.trainable)
        return self

    @property
    def field_widths(self) -> dict[str, int]:
        """The embedders' widths summed per field, as `combine` concatenates their outputs."""
        widths: dict[str, int] = {}
        for embedder in self.embedders:
            for field, width in embedder.field_widths.items():
                widths[field] = widths.get(field, 0) + width
        return widths

    def lora_targets(self) -> list:
        """The text towers' (CLIP-L, OpenCLIP bigG), in embedder order: kohya's `lora_te1_` /
        `lora_te2_`. Each embedder says its own (none for the size / crop embedders)."""
        return [target for e in self.embedders for target in e.lora_targets()]

    def batch_of(self, inputs) -> dict:
        """Prompts given alone -> the batch this conditioner reads."""
        return dict(inputs) if isinstance(inputs, Mapping) else {CAPTION_KEY: list(inputs)}

    # --- the conditioning dict ------------------------------------------------------------
    def condition(
        self, batch: Mapping, generator: torch.Generator | None = None, drop: bool = False
    ) -> dict[str, torch.Tensor]:
        """`{"crossattn", "vector"}` for `batch`; with `drop`, each input key is dropped per
        sample with its rate (draws from `generator`, else the global CPU generator)."""
        n = batch_size(batch)
        dropped = {}
        if drop:
            device = generator.device if generator is not None else "cpu"
            for key, rate in self._drop_rates().items():
                if rate > 0:
                    dropped[key] = torch.rand(n, generator=generator, device=device) < rate
        outputs = [self._embed(e, batch, n, dropped.get(e.input_key)) for e in self.embedders]
        return combine(outputs)

    def unconditional(self, batch: Mapping, negative=None) -> dict[str, torch.Tensor]:
        """The guidance's unconditional side: the embeddings of the `negative` prompts, zeros
        where there is none (None or "": diffusers' `force_zeros_for_empty_prompt`, as SDXL is
        sampled by sgm and diffusers); the size / crop inputs as in `batch`."""
        n = batch_size(batch)
        negative = [""] * n if negative is None else [text or "" for text in negative]
        batch = {**batch, CAPTION_KEY: negative}
        dropped = None
        if self.force_zeros_for_empty_prompt:
            dropped = torch.tensor([text == "" for text in negative])
        outputs = [
            self._embed(e, batch, n, dropped if e.input_key == CAPTION_KEY else None)
            for e in self.embedders
        ]
        return combine(outputs)

    def _drop_rates(self) -> dict[str, float]:
        rates: dict[str, float] = {}
        for embedder in self.embedders:
            key = embedder.input_key
            rates[key] = max(rates.get(key, 0.0), embedder.drop_rate)
        return rates

    def _embed(self, embedder, batch: Mapping, n: int, dropped: torch.Tensor | None):
        """The embedder's outputs (a tuple) for its input, with the `dropped` samples nulled."""
        inputs = self._inputs(batch, embedder.input_key, n)
        legacy = embedder.legacy_ucg_value
        if dropped is not None and legacy is not None:
            keep = (~dropped).tolist()
            inputs = [x if k else legacy for x, k in zip(inputs, keep)]
        with torch.set_grad_enabled(embedder.trainable and torch.is_grad_enabled()):
            out = embedder(inputs)
        out = out if isinstance(out, tuple) else (out,)
        if dropped is not None and legacy is None:  # sgm: the embedding times 0
            keep = (~dropped).to(out[0].device)
            out = tuple(o * keep.view(-1, *[1] * (o.dim() - 1)).to(o.dtype) for o in out)
        return out

    def _inputs(self, batch: Mapping, key: str, n: int):
        """`batch[key]`; the size keys as float (B, 2) tensors, with their defaults."""
        if key not in SIZE_KEYS:
            if key not in batch:
                raise KeyError(f"the conditioner reads batch['{key}'], which the batch lacks")
            return batch[key]
        device = self._device()
        if key in batch:
            return pairs(batch[key], n, device)
        if key == "crop_coords_top_left":
            return torch.zeros(n, 2, device=device)
        if key == "original_size_as_tuple":
            return self._inputs(batch, "target_size_as_tuple", n)
        if "image" in batch:
            return pairs(tuple(batch["image"].shape[-2:]), n, device)
        if "image_size" in batch:
            return pairs(batch["image_size"], n, device)
        raise KeyError(
            "the conditioner needs the image size: batch['target_size_as_tuple'] (or 'image', "
            "'image_size') - cached latents must keep their sizes"
        )

    def _device(self) -> torch.device:
        weight = next(self.parameters(), None)
        return weight.device if weight is not None else torch.device("cpu")


def batch_size(batch: Mapping) -> int:
    if CAPTION_KEY in batch:
        return len(batch[CAPTION_KEY])
    for value in batch.values():
        if isinstance(value, (torch.Tensor, list, tuple)) and len(value):
            return len(value)
    raise ValueError("cannot tell the batch size: no caption and no tensor in the batch")


def pairs(value, n: int, device) -> torch.Tensor:
    """(height, width)-like inputs -> float (n, 2): one pair for all, or one per sample."""
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=torch.float32)
    else:
        value = torch.as_tensor(
            [list(map(float, v)) for v in value]
            if value and isinstance(value[0], (list, tuple, torch.Tensor))
            else [float(v) for v in value],
            device=device,
        )
    value = value.expand(n, 2) if value.dim() == 1 else value
    if value.shape != (n, 2):
        raise ValueError(f"expected {n} (height, width)-like pairs, got shape {tuple(value.shape)}")
    return value


def combine(outputs: Sequence[tuple]) -> dict[str, torch.Tensor]:
    """Embedder outputs -> fields by rank: (B, D) into `vector`, (B, T, D) into `crossattn`,
    concatenated along channels in embedder order (sgm's GeneralConditioner)."""
    fields: dict[str, list] = {}
    for out in outputs:
        for tensor in out:
            if tensor.dim() not in FIELD_BY_NDIM:
                raise ValueError(f"an embedder output of shape {tuple(tensor.shape)} has no field")
            fields.setdefault(FIELD_BY_NDIM[tensor.dim()], []).append(tensor)
    device = next(t.device for ts in fields.values() for t in ts)
    return {name: torch.cat([t.to(device) for t in ts], dim=-1) for name, ts in fields.items()}
