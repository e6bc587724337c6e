"""The Stable Diffusion UNet: `UNet(UNetConfig)`, presets `sd15()`, `sd2()`, `sdxl()`, and
`UNetModel`, the original CompVis / sgm `openaimodel.UNetModel` spelling that configs name.

Architecture of Rombach et al. 2022 ("High-Resolution Image Synthesis with Latent Diffusion
Models", app. E), built on the ADM UNet of Dhariwal & Nichol 2021: ResBlocks with a timestep
embedding, SpatialTransformers (cross-attention to the text context) at the resolutions listed
in `attention_resolutions`, skip connections from each input block to its mirrored output block.
A model built from the original `unet_config` has exactly the original state-dict keys
(`time_embed.0`, `input_blocks.1.0.in_layers.0`, `middle_block.1.proj_in`, `out.2`, ...).
SDXL (Podell et al. 2023, arXiv:2307.01952, sec. 2.1) is the same network with a transformer
depth per level ([1, 2, 10]: none at the highest resolution) and a `vector` input (pooled text +
size/crop embeddings, 2816 channels) added to the timestep embedding through `label_emb`.

    unet = sdxl(use_checkpoint=True)                       # a preset
    unet = UNet(replace(SD2, image_size=96))               # a preset's layout, changed
    unet = UNetModel(**config.model.params.unet_config.params)   # an original config

What a UNet needs from its conditioner it says itself: `field_widths` (the width of each field
it reads: `crossattn` context_dim, `vector` adm_in_channels, `y` num_classes), `vector_dim` (the
`vector` field's width, None without one) and `label_field`.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ldm.attention import SpatialTransformer, check_attention_backend
from ldm.compat_api import named_conditioning


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0):
    """Sinusoidal embedding of (possibly fractional) timesteps, (B,) -> (B, dim), float32.

    Transformer positional encoding (Vaswani et al. 2017, sec. 3.5) with the original's layout:
    [cos | sin], frequencies max_period^(-i / half) for i < half (diffusers: flip_sin_to_cos=True,
    downscale_freq_shift=0).
    """
    half = dim // 2
    steps = torch.arange(half, dtype=torch.float32, device=timesteps.device)
    # Operation order as the original: at t ~ 1000 a different float rounding of the frequencies
    # moves the embedding by ~1e-4.
    freqs = torch.exp(-math.log(max_period) * steps / half)  # (half,)
    args = timesteps[:, None].float() * freqs[None]  # (B, half)
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, 2 * half)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


def group_norm(channels: int) -> nn.GroupNorm:
    """The original `normalization()`: GroupNorm with 32 groups.

    The original's GroupNorm32 upcast the input to float32; PyTorch's group-norm kernels already
    accumulate fp16 / bf16 inputs in float32, so the extra casts are left out.
    """
    return nn.GroupNorm(32, channels)


class TimestepEmbedSequential(nn.Sequential):
    """A Sequential that hands the timestep embedding to ResBlocks and the context to
    SpatialTransformers."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor | None = None):
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            else:
                x = layer(x)
        return x  # (B, C', H', W')


class ResBlock(nn.Module):
    """Residual block (Ho et al. 2020 / ADM) with the timestep embedding added after the first conv.

    in_layers = [GroupNorm, SiLU, Conv3x3], emb_layers = [SiLU, Linear],
    out_layers = [GroupNorm, SiLU, Dropout, Conv3x3 (zero-initialised)], skip_connection =
    Identity or a 1x1 conv when the channel count changes.
    """

    def __init__(self, channels: int, emb_channels: int, dropout: float, out_channels: int):
        super().__init__()
        self.in_layers = nn.Sequential(
            group_norm(channels), nn.SiLU(), nn.Conv2d(channels, out_channels, 3, padding=1)
        )
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels))
        self.out_layers = nn.Sequential(
            group_norm(out_channels),
            nn.SiLU(),
            nn.Dropout(dropout),
            zero_init(nn.Conv2d(out_channels, out_channels, 3, padding=1)),
        )
        if out_channels == channels:
            self.skip_connection = nn.Identity()
        else:
            self.skip_connection = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)  # (B, C_out, H, W)
        # In-place: a conv does not keep its output for backward.
        h.add_(self.emb_layers(emb)[:, :, None, None])
        h = self.out_layers(h)  # (B, C_out, H, W)
        return h.add_(self.skip_connection(x))


class Downsample(nn.Module):
    """Stride-2 3x3 conv (`op`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)  # (B, C, H / 2, W / 2)


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 conv (`conv`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")  # (B, C, 2H, 2W)
        return self.conv(x)


def zero_init(module: nn.Module) -> nn.Module:
    """Zero a layer's parameters so its residual branch starts as the identity (ADM)."""
    for param in module.parameters():
        nn.init.zeros_(param)
    return module


@dataclass
class UNetConfig:
    """The layout of a UNet: everything that decides its state dict (names and shapes), under
    the original `unet_config.params` names (so an original config is `UNetConfig(**layout)`).

    Args:
        model_channels: base width (320 for SD); every width is a multiple of it.
        channel_mult: width multiplier per level ([1, 2, 4, 4] for SD); one halving per level.
        num_res_blocks: ResBlocks per level on the way down (one more on the way up).
        attention_resolutions: downsampling factors (1, 2, 4, ...) whose blocks get a
            SpatialTransformer ([4, 2, 1] for SD).
        transformer_depth: BasicTransformerBlocks per SpatialTransformer: one number, or one per
            level (SDXL: [1, 2, 10]; the same depth on the way up).
        transformer_depth_middle: depth of the middle block's transformer (default: the last
            level's).
        num_heads: attention heads per transformer (SD 1: 8); used when num_head_channels = -1.
        num_head_channels: channels per head (SD 2: 64); heads = width // num_head_channels.
        legacy: the original head-size rule (dim_head = width // heads); only differs when the
            width is not a multiple of num_head_channels.
        use_linear_in_transformer: proj_in / proj_out are Linear (SD 2, XL) instead of 1x1 convs.
        context_dim: width of the cross-attention context (768 for CLIP ViT-L, 1024 for OpenCLIP H).
        in_channels: latent channels in (4 for SD).
        out_channels: channels predicted (4: eps or v).
        num_classes: optional class conditioning (label_emb), passed as `y` to forward; or
            "sequential" (sgm, SDXL): `label_emb` is an MLP of the `vector` field, whose width is
            `adm_in_channels`.
        adm_in_channels: width of the `vector` conditioning (SDXL: 1280 pooled text + 3 x 512
            size / crop features = 2816); only with num_classes "sequential".
        image_size: the latent size it was trained at (default sample size); the UNet itself
            takes any size that is a multiple of `size_multiple`. No weight depends on it.
    """

    model_channels: int
    channel_mult: Sequence[int]
    num_res_blocks: int
    attention_resolutions: Sequence[int]
    transformer_depth: int | Sequence[int] = 1
    transformer_depth_middle: int | None = None
    num_heads: int = -1
    num_head_channels: int = -1
    legacy: bool = False
    use_linear_in_transformer: bool = False
    context_dim: int | None = None
    in_channels: int = 4
    out_channels: int = 4
    num_classes: int | str | None = None
    adm_in_channels: int | None = None
    image_size: int | None = None

    def __post_init__(self):
        # Checked, not rewritten: `dataclasses.replace` of a preset must see the fields as given.
        depth = self.transformer_depth
        if not isinstance(depth, int) and len(depth) != len(self.channel_mult):
            raise ValueError(
                f"transformer_depth {list(depth)}: expected one depth per level "
                f"of channel_mult {list(self.channel_mult)}"
            )
        if self.num_heads == -1 and self.num_head_channels == -1:
            raise ValueError("set either num_heads or num_head_channels")
        if self.model_channels % 32:  # every width is a multiple of it; group_norm has 32 groups
            raise ValueError(f"model_channels={self.model_channels}: expected a multiple of 32")
        if (self.num_classes == "sequential") != (self.adm_in_channels is not None):
            raise ValueError('adm_in_channels goes with num_classes: "sequential" (and back)')
        if isinstance(self.num_classes, str) and self.num_classes != "sequential":
            raise ValueError(
                f'num_classes: {self.num_classes!r} is neither a number nor "sequential"'
            )

    def depth(self, level: int) -> int:
        """Transformer depth at a level (index into channel_mult)."""
        depth = self.transformer_depth
        return depth if isinstance(depth, int) else depth[level]

    @property
    def middle_depth(self) -> int:
        """The middle block's transformer depth (default: the last level's)."""
        if self.transformer_depth_middle is not None:
            return self.transformer_depth_middle
        return self.depth(len(self.channel_mult) - 1)

    @property
    def vector_dim(self) -> int | None:
        """Width of the `vector` conditioning field it needs (SDXL's 2816), None without one."""
        return self.adm_in_channels

    @property
    def label_field(self) -> str | None:
        """The conditioning field label_emb reads: "vector" (SDXL), "y" (class ids) or None."""
        return "vector" if self.adm_in_channels else "y" if self.num_classes else None

    @property
    def field_widths(self) -> dict[str, int]:
        """The width of each conditioning field it reads (for `y`, the class count)."""
        widths = {"crossattn": self.context_dim, "vector": self.adm_in_channels}
        widths["y"] = self.num_classes  # "sequential" (SDXL) reads `vector` instead
        read = ("crossattn", self.label_field)  # no context_dim: no text context
        return {f: w for f, w in widths.items() if f in read and w is not None}

    def heads(self, width: int) -> tuple[int, int]:
        """(heads, channels per head) of a `width`-channel transformer."""
        if self.num_head_channels == -1:
            heads, dim_head = self.num_heads, width // self.num_heads
        else:
            heads, dim_head = width // self.num_head_channels, self.num_head_channels
        if heads < 1:
            raise ValueError(
                f"a {width}-channel transformer cannot have heads of {self.num_head_channels} "
                "channels"
            )
        return heads, width // heads if self.legacy else dim_head


class UNet(nn.Module):
    """The Stable Diffusion UNet (v1, v2, XL) built from its layout; presets below (`sd15()`,
    `sd2()`, `sdxl()`), original configs through `UNetModel`.

    Args:
        config: the layout (`UNetConfig`).
        dropout: dropout in ResBlocks and attention.
        attention_backend: "sdpa" (torch scaled_dot_product_attention) or "xformers".
        upcast_attention: compute attention in float32 under mixed precision (SD 2.x 768 v-model).
        use_checkpoint: gradient checkpointing of every UNet block while training (trades one
            extra forward pass for activation memory).
    """

    # The config key that sets each conditioning field's width (ldm.conditioning's check).
    field_keys = {"crossattn": "context_dim", "vector": "adm_in_channels", "y": "num_classes"}

    def __init__(
        self,
        config: UNetConfig,
        *,
        dropout: float = 0.0,
        attention_backend: str = "sdpa",
        upcast_attention: bool = False,
        use_checkpoint: bool = False,
    ):
        super().__init__()
        check_attention_backend(attention_backend)
        self.config = config
        self.dropout, self.use_checkpoint = dropout, use_checkpoint
        self._attention = {"backend": attention_backend, "upcast": upcast_attention}
        self.model_channels = config.model_channels
        self.label_field, self.vector_dim = config.label_field, config.vector_dim
        self.field_widths = config.field_widths
        # Geometry LatentDiffusion asks for: channels in, the native latent size (for default
        # sample sizes), and the factor sides must divide by (one halving per level).
        self.in_channels, self.image_size = config.in_channels, config.image_size
        self.size_multiple = 2 ** (len(config.channel_mult) - 1)
        self.time_embed_dim = 4 * config.model_channels

        self.time_embed = nn.Sequential(
            nn.Linear(config.model_channels, self.time_embed_dim),
            nn.SiLU(),
            nn.Linear(self.time_embed_dim, self.time_embed_dim),
        )
        label_emb = self._label_embedding()
        if label_emb is not None:
            self.label_emb = label_emb
        self.input_blocks, skip_channels = self._input_blocks()
        self.middle_block = self._middle_block(skip_channels[-1])
        self.output_blocks = self._output_blocks(skip_channels)
        self.out = nn.Sequential(
            group_norm(config.model_channels * config.channel_mult[0]),
            nn.SiLU(),
            zero_init(nn.Conv2d(config.model_channels, config.out_channels, 3, padding=1)),
        )

    # --- builders (the original `openaimodel.UNetModel.__init__`, block by block) -------------

    def _label_embedding(self) -> nn.Module | None:
        """Class ids or SDXL's `vector`, added to the timestep embedding (`label_emb`)."""
        config = self.config
        if config.adm_in_channels is not None:  # sgm's name: label_emb.0.{0,2}
            mlp = nn.Sequential(
                nn.Linear(config.adm_in_channels, self.time_embed_dim),
                nn.SiLU(),
                nn.Linear(self.time_embed_dim, self.time_embed_dim),
            )
            return nn.Sequential(mlp)
        if config.num_classes is not None:
            return nn.Embedding(config.num_classes, self.time_embed_dim)
        return None

    def _resblock(self, channels: int, out_channels: int) -> "ResBlock":
        return ResBlock(channels, self.time_embed_dim, self.dropout, out_channels)

    def _transformer(self, width: int, depth: int) -> SpatialTransformer:
        heads, dim_head = self.config.heads(width)
        return SpatialTransformer(
            width,
            heads,
            dim_head,
            depth=depth,
            context_dim=self.config.context_dim,
            dropout=self.dropout,
            use_linear=self.config.use_linear_in_transformer,
            **self._attention,
        )

    def _input_blocks(self) -> tuple[nn.ModuleList, list[int]]:
        """The way down, and the channels of each block's output (the skips)."""
        config = self.config
        width = config.model_channels
        blocks = nn.ModuleList(
            [TimestepEmbedSequential(nn.Conv2d(config.in_channels, width, 3, padding=1))]
        )
        skip_channels, factor = [width], 1
        for level, mult in enumerate(config.channel_mult):
            for _ in range(config.num_res_blocks):
                layers = [self._resblock(width, config.model_channels * mult)]
                width = config.model_channels * mult
                if factor in config.attention_resolutions:
                    layers.append(self._transformer(width, config.depth(level)))
                blocks.append(TimestepEmbedSequential(*layers))
                skip_channels.append(width)
            if level != len(config.channel_mult) - 1:
                blocks.append(TimestepEmbedSequential(Downsample(width)))
                skip_channels.append(width)
                factor *= 2
        return blocks, skip_channels

    def _middle_block(self, width: int) -> "TimestepEmbedSequential":
        return TimestepEmbedSequential(
            self._resblock(width, width),
            self._transformer(width, self.config.middle_depth),
            self._resblock(width, width),
        )

    def _output_blocks(self, skip_channels: list[int]) -> nn.ModuleList:
        """The way up: each block takes its mirrored skip (popped from `skip_channels`)."""
        config = self.config
        width, factor = skip_channels[-1], self.size_multiple
        blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(config.channel_mult))):
            for i in range(config.num_res_blocks + 1):
                layers = [self._resblock(width + skip_channels.pop(), config.model_channels * mult)]
                width = config.model_channels * mult
                if factor in config.attention_resolutions:
                    layers.append(self._transformer(width, config.depth(level)))
                if level and i == config.num_res_blocks:
                    layers.append(Upsample(width))
                    factor //= 2
                blocks.append(TimestepEmbedSequential(*layers))
        return blocks

    # --- running ---------------------------------------------------------------------------------

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Turn gradient checkpointing of the UNet blocks on or off (training only)."""
        self.use_checkpoint = enabled

    def _run(self, block: TimestepEmbedSequential, h, emb, context):
        if self.use_checkpoint and self.training and torch.is_grad_enabled():
            return checkpoint(block, h, emb, context, use_reentrant=False)
        return block(h, emb, context)

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Mapping[str, torch.Tensor] | None = None,
        context: torch.Tensor | None = None,
        y: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict eps (or v) for x (B, C, H, W) at timesteps (B,) given the conditioning fields
        `crossattn` (B, M, D) (cross-attention context), and `y` (B,) (class ids, with
        num_classes) or `vector` (B, adm_in_channels) (SDXL). The original call
        `forward(x, timesteps, context, y=...)` works too (`ldm.compat_api`)."""
        cond = named_conditioning(cond, context, y)
        context = cond.get("crossattn")
        label = cond.get(self.label_field) if self.label_field else None
        if self.label_field and label is None:
            raise ValueError(f"this UNet takes the conditioning field {self.label_field!r}")
        if not self.label_field and cond.get("y") is not None:
            raise ValueError("pass class labels y exactly when the model has num_classes")
        # float32 sinusoids, cast to the weights' dtype so a model converted with .half() works.
        t_emb = timestep_embedding(timesteps, self.model_channels)  # (B, model_channels)
        t_emb = t_emb.to(self.time_embed[0].weight.dtype)
        emb = self.time_embed(t_emb)  # (B, 4 * model_channels)
        if label is not None:  # (B,) ids or (B, adm_in_channels) in the weights' dtype
            label = label if self.label_field == "y" else label.to(emb.dtype)
            emb = emb + self.label_emb(label)
        skips = []
        h = x
        for block in self.input_blocks:
            h = self._run(block, h, emb, context)  # (B, C_level, H / f, W / f)
            skips.append(h)
        h = self._run(self.middle_block, h, emb, context)  # (B, C_max, H / f_max, W / f_max)
        for block in self.output_blocks:
            h = torch.cat([h, skips.pop()], dim=1)  # (B, C + C_skip, H / f, W / f)
            h = self._run(block, h, emb, context)
        return self.out(h)  # (B, out_channels, H, W)

    def blocks_in_order(self) -> list[nn.Module]:
        """The blocks base quantization and block swap act on (ldm.block_swap.blocks_of), in
        the order they run: the input blocks after the first, the middle block, the output
        blocks. Left as they are: the first input block (conv_in, the latent's embedding, a
        4 -> C convolution), the timestep and label embeddings, and the output layer (`out`)."""
        return [*self.input_blocks[1:], self.middle_block, *self.output_blocks]


class UNetModel(UNet):
    """The original CompVis / sgm `openaimodel.UNetModel`: its `unet_config.params` unchanged
    (the layout names are `UNetConfig`'s, the rest are `UNet`'s options).

    use_spatial_transformer must be True (the text-conditioned UNet); use_fp16 is accepted and
    unused: precision comes from the trainer (Lightning `precision: 16-mixed / bf16-mixed`).
    """

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        model_channels: int,
        attention_resolutions: Sequence[int],
        num_res_blocks: int,
        channel_mult: Sequence[int],
        num_heads: int = -1,
        num_head_channels: int = -1,
        use_spatial_transformer: bool = True,
        use_linear_in_transformer: bool = False,
        transformer_depth: int | Sequence[int] = 1,
        transformer_depth_middle: int | None = None,
        context_dim: int | None = None,
        use_checkpoint: bool = False,
        use_fp16: bool = False,
        legacy: bool = False,
        dropout: float = 0.0,
        attention_backend: str = "sdpa",
        upcast_attention: bool = False,
        num_classes: int | str | None = None,
        adm_in_channels: int | None = None,
        image_size: int | None = None,
    ):
        if not use_spatial_transformer:
            raise ValueError(
                "use_spatial_transformer=False (ADM self-attention UNet) is not supported"
            )
        layout = UNetConfig(
            model_channels=model_channels,
            channel_mult=channel_mult,
            num_res_blocks=num_res_blocks,
            attention_resolutions=attention_resolutions,
            transformer_depth=transformer_depth,
            transformer_depth_middle=transformer_depth_middle,
            num_heads=num_heads,
            num_head_channels=num_head_channels,
            legacy=legacy,
            use_linear_in_transformer=use_linear_in_transformer,
            context_dim=context_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            num_classes=num_classes,
            adm_in_channels=adm_in_channels,
            image_size=image_size,
        )
        if image_size is None:  # sgm configs give none: a released layout samples at its own size
            layout = with_released_image_size(layout)
        super().__init__(
            layout,
            dropout=dropout,
            attention_backend=attention_backend,
            upcast_attention=upcast_attention,
            use_checkpoint=use_checkpoint,
        )


# --- presets: the released models' layouts (their original configs' unet_config) -------------

# SD 1.x (CompVis v1-inference.yaml): CLIP ViT-L/14 context, 8 heads.
SD15 = UNetConfig(
    model_channels=320,
    channel_mult=(1, 2, 4, 4),
    num_res_blocks=2,
    attention_resolutions=(4, 2, 1),
    num_heads=8,
    context_dim=768,
    image_size=64,
)
# SD 2.x (Stability-AI v2-inference.yaml): OpenCLIP ViT-H/14 context, 64-channel heads, linear
# proj_in / proj_out. The 768 px v-model is the same layout at image_size 96.
SD2 = replace(
    SD15,
    num_heads=-1,
    num_head_channels=64,
    use_linear_in_transformer=True,
    context_dim=1024,
)
# SDXL base (sgm sd_xl_base.yaml; Podell et al. 2023, sec. 2.1): 3 levels, no attention at the
# highest resolution, transformer depth [1, 2, 10], CLIP-L + bigG context (768 + 1280), a 2816-wide
# vector (pooled text + size / crop), trained at 1024 px (128 latent pixels).
SDXL = replace(
    SD2,
    channel_mult=(1, 2, 4),
    attention_resolutions=(4, 2),
    transformer_depth=(1, 2, 10),
    context_dim=2048,
    num_classes="sequential",
    adm_in_channels=2816,
    image_size=128,
)


PRESETS = (SD15, SD2, SDXL)


def with_released_image_size(layout: UNetConfig) -> UNetConfig:
    """`layout` with the image_size of the released model of that layout (SDXL base: 128 latent
    pixels, trained at 1024 px); unchanged for a layout no preset has (a toy width, a refiner).
    A layout, not a family: a toy SDXL keeps the default sample size."""

    def fields(config: UNetConfig) -> dict:
        values = {**vars(config), "image_size": None}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}

    preset = next((p for p in PRESETS if fields(p) == fields(layout)), None)
    return replace(layout, image_size=preset.image_size) if preset else layout


def sd15(image_size: int = 64, **options) -> UNet:
    """The SD 1.x UNet (`options`: UNet's dropout, attention_backend, use_checkpoint, ...)."""
    return UNet(replace(SD15, image_size=image_size), **options)


def sd2(image_size: int = 64, **options) -> UNet:
    """The SD 2.x UNet (image_size 96 for the 768 px v-model)."""
    return UNet(replace(SD2, image_size=image_size), **options)


def sdxl(image_size: int = 128, **options) -> UNet:
    """The SDXL base UNet."""
    return UNet(replace(SDXL, image_size=image_size), **options)
