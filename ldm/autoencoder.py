"""The KL-regularised autoencoder of Latent Diffusion (Rombach et al. 2022, arXiv:2112.10752, Sec. 3).

Parameter names follow the original CompVis `ldm.modules.diffusionmodules.model` /
`ldm.models.autoencoder` exactly (`encoder.down.N.block.M.conv1`, `decoder.up.N.upsample.conv`,
`quant_conv`, ...), so the `first_stage_model.*` weights of every SD v1/v2 checkpoint load with
`strict=True`. SD 3/3.5's VAE (Esser et al. 2024, arXiv:2403.03206, Sec. 5.2.1: 16 latent channels)
is the same network without `quant_conv` / `post_quant_conv` (`use_quant_conv: false`), as
Stability's `sd3_impls.SDVAE` builds it: its `first_stage_model.*` weights load the same way. This is the VAE as a diffusion model's first stage; training it (loss,
discriminator, optimizers) is `ldm.autoencoder_training.AutoencoderKLTraining`.
"""

import torch
import torch.nn.functional as F
from torch import nn

# ddconfig keys of the original configs. `attn_type` "vanilla-xformers" (commented out in the v2
# config) only chose a faster kernel there; here both run on torch SDPA.
REQUIRED_DDCONFIG_KEYS = frozenset(
    ("z_channels", "resolution", "in_channels", "out_ch", "ch", "ch_mult", "num_res_blocks")
)
DDCONFIG_KEYS = REQUIRED_DDCONFIG_KEYS | {"double_z", "attn_resolutions", "dropout", "attn_type"}
# What Encoder and Decoder both take (plus in_channels / out_ch respectively).
SHARED_DDCONFIG_KEYS = (
    "ch",
    "ch_mult",
    "num_res_blocks",
    "attn_resolutions",
    "dropout",
    "resolution",
    "z_channels",
)
ATTN_TYPES = ("vanilla", "vanilla-xformers")
IDENTITY_LOSSES = (None, "torch.nn.Identity")


def normalize(channels: int) -> nn.GroupNorm:
    """GroupNorm(32) with the original eps (1e-6); widths must be multiples of 32."""
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block (GroupNorm, SiLU, 3x3 conv) x2, 1x1 `nin_shortcut` on width change."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = normalize(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B, C_out, H, W)
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))  # (B, C_out, H, W)
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all H*W positions; q/k/v/proj_out are 1x1 convs as in the original."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = normalize(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)

        def tokens(conv: nn.Conv2d) -> torch.Tensor:
            # Contiguous (B, 1, HW, C): SDPA's fused kernels (flash on the CPU, memory-efficient
            # and flash on GPUs) need the channel stride to be 1; a transposed view falls back to
            # the math path, which holds the HW x HW logits - 32 GiB for two 512 px images in a
            # 2-level VAE's mid block. The fused kernels never materialise that matrix.
            return conv(normed).reshape(b, 1, c, h * w).transpose(-1, -2).contiguous()

        # softmax(q k^T / sqrt(C)) v - SDPA's default scale is the original's c**-0.5. In float32
        # under half-precision autocast: one head over C = 512 channels sums 512 products per
        # logit, which large activations push past float16's range (lowest resolution: cheap).
        q, k, v = tokens(self.q), tokens(self.k), tokens(self.v)
        with torch.autocast(x.device.type, enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(v.dtype)
        out = out.transpose(-1, -2).reshape(b, c, h, w)  # (B, C, H, W)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 3x3 conv after an asymmetric (right/bottom) zero pad, as the original."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # (B, C, H/2, W/2)


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))  # (B, C, 2H, 2W)


class MidBlock(nn.Module):
    """ResnetBlock -> AttnBlock -> ResnetBlock at the lowest resolution (`mid.block_1/attn_1/block_2`)."""

    def __init__(self, channels: int, dropout: float):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


def _level(
    in_channels: int, out_channels: int, num_blocks: int, with_attn: bool, dropout: float
) -> nn.Module:
    """One resolution level: `block` (ResnetBlocks) and `attn` (empty unless the level attends)."""
    level = nn.Module()
    level.block = nn.ModuleList(
        ResnetBlock(in_channels if i == 0 else out_channels, out_channels, dropout)
        for i in range(num_blocks)
    )
    level.attn = nn.ModuleList(
        AttnBlock(out_channels) for _ in range(num_blocks if with_attn else 0)
    )
    return level


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(level.block):
        h = block(h)
        if len(level.attn) > 0:
            h = level.attn[i](h)
    return h


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) -> Gaussian moments (B, 2*z_channels, H/f, W/f), f = 2**(len(ch_mult)-1)."""

    def __init__(
        self,
        *,
        ch: int,
        ch_mult: tuple[int, ...],
        num_res_blocks: int,
        attn_resolutions: tuple[int, ...],
        dropout: float,
        in_channels: int,
        resolution: int,
        z_channels: int,
    ):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in, current_res = ch, resolution
        for i, mult in enumerate(ch_mult):
            level = _level(
                block_in, ch * mult, num_res_blocks, current_res in attn_resolutions, dropout
            )
            block_in = ch * mult
            if i != len(ch_mult) - 1:
                level.downsample = Downsample(block_in)
                current_res //= 2
            self.down.append(level)
        self.mid = MidBlock(block_in, dropout)
        self.norm_out = normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # (B, ch, H, W)
        for level in self.down:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid(h)  # (B, ch*ch_mult[-1], H/f, W/f)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, 2*z_channels, H/f, W/f)


class Decoder(nn.Module):
    """Latent (B, z_channels, h, w) -> image (B, out_ch, h*f, w*f); `up` is stored low-res last as the original."""

    def __init__(
        self,
        *,
        ch: int,
        out_ch: int,
        ch_mult: tuple[int, ...],
        num_res_blocks: int,
        attn_resolutions: tuple[int, ...],
        dropout: float,
        resolution: int,
        z_channels: int,
    ):
        super().__init__()
        block_in = ch * ch_mult[-1]
        current_res = resolution // 2 ** (len(ch_mult) - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = MidBlock(block_in, dropout)
        # Built from the lowest resolution up, but indexed like the encoder (up.0 = full
        # resolution): the original inserts each level at the front of the list.
        levels = []
        for i in reversed(range(len(ch_mult))):
            level = _level(
                block_in,
                ch * ch_mult[i],
                num_res_blocks + 1,
                current_res in attn_resolutions,
                dropout,
            )
            block_in = ch * ch_mult[i]
            if i != 0:
                level.upsample = Upsample(block_in)
                current_res *= 2
            levels.insert(0, level)
        self.up = nn.ModuleList(levels)
        self.norm_out = normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, padding=1)
        self.float32_output = False  # set by the VAE trainer: conv_out outside autocast

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))  # (B, ch*ch_mult[-1], h, w)
        for level in reversed(self.up):
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        h = F.silu(self.norm_out(h))
        if self.float32_output:
            with torch.autocast(h.device.type, enabled=False):
                return self.conv_out(h.to(self.conv_out.weight.dtype))  # (B, out_ch, h*f, w*f)
        return self.conv_out(h)  # (B, out_ch, h*f, w*f)


class DiagonalGaussianDistribution:
    """The VAE posterior q(z|x) = N(mean, diag(exp(logvar))) from stacked moments (B, 2*C, h, w)."""

    def __init__(self, parameters: torch.Tensor):
        self.mean, logvar = torch.chunk(parameters, 2, dim=1)  # (B, C, h, w) each
        # Same clamp as the original: keeps exp() finite for an untrained or fp16 encoder.
        self.logvar = torch.clamp(logvar, -30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Reparameterised draw mean + std * eps; pass a generator on the tensor's device to seed it."""
        noise = torch.randn(
            self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype
        )
        return self.mean + self.std * noise

    def mode(self) -> torch.Tensor:
        return self.mean


class AutoencoderKL(nn.Module):
    """The SD first stage: images in [-1, 1] <-> latents (before `scale_factor`).

    Args:
        ddconfig: the original encoder/decoder config: `ch` (base width, a multiple of 32),
            `ch_mult` (width multiplier per level; the latent is 2**(len-1) times smaller),
            `num_res_blocks`, `attn_resolutions` (resolutions, counted from `resolution`, whose
            levels attend; [] in SD), `dropout`, `in_channels`, `out_ch`, `resolution`,
            `z_channels`, `double_z` (must be true: mean and log-variance), `attn_type`.
        embed_dim: latent channels after `quant_conv` (4 in SD; 16 in SD3, where it must equal
            `z_channels`: there is no `quant_conv`).
        lossconfig: only `torch.nn.Identity` (or None): this module is not trained (see
            `ldm.autoencoder_training` for the trainable one).
        ckpt_path: optional weights file (`.safetensors` / `.ckpt`) holding this VAE, bare or
            under `first_stage_model.`, e.g. a fine-tuned VAE swapped into a model.
        ignore_keys: key prefixes dropped from `ckpt_path` before loading.
        monitor, image_key: accepted from the original configs; unused (no VAE training).
        scale_factor, shift_factor: the latent geometry this VAE was made with: the diffusion
            model's latents are (z - shift_factor) * scale_factor (diffusers' `scaling_factor`
            and `shift_factor`; SD3's VAE: 1.5305 and 0.0609). None: the diffusion model says.
        use_quant_conv: the 1x1 `quant_conv` / `post_quant_conv` around the latent (SD 1.x, 2.x,
            SDXL); false for SD 3/3.5 (and Flux), whose encoder writes the moments directly.
    """

    CKPT_PATH_KEY = "first_stage_config.params.ckpt_path"  # its name in messages

    def __init__(
        self,
        ddconfig: dict,
        embed_dim: int,
        lossconfig: dict | None = None,
        ckpt_path: str | None = None,
        ignore_keys: tuple[str, ...] = (),
        monitor: str | None = None,
        image_key: str = "image",
        scale_factor: float | None = None,
        shift_factor: float = 0.0,
        use_quant_conv: bool = True,
    ):
        super().__init__()
        self.scale_factor, self.shift_factor = scale_factor, shift_factor
        ddconfig = _checked_ddconfig(ddconfig)
        if not use_quant_conv and embed_dim != ddconfig["z_channels"]:
            raise ValueError(
                f"first_stage_config.params.embed_dim={embed_dim}: without quant_conv "
                f"(use_quant_conv: false) it must equal ddconfig.z_channels={ddconfig['z_channels']}"
            )
        loss_target = None if lossconfig is None else lossconfig.get("target")
        if loss_target not in IDENTITY_LOSSES:
            raise ValueError(
                f"first_stage_config.params.lossconfig.target: '{loss_target}' is not supported; "
                "this VAE is frozen (torch.nn.Identity or no lossconfig); to train a VAE use the "
                "target ldm.autoencoder_training.AutoencoderKLTraining"
            )
        z_channels = ddconfig["z_channels"]
        shared = {k: ddconfig[k] for k in SHARED_DDCONFIG_KEYS}
        self.encoder = Encoder(in_channels=ddconfig["in_channels"], **shared)
        self.decoder = Decoder(out_ch=ddconfig["out_ch"], **shared)
        self.use_quant_conv = use_quant_conv
        if use_quant_conv:
            self.quant_conv = nn.Conv2d(2 * z_channels, 2 * embed_dim, 1)
            self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)
        self.embed_dim = embed_dim
        # Geometry LatentDiffusion asks for: latent channels and the downsampling factor.
        self.latent_channels = embed_dim
        self.downscale = 2 ** (len(ddconfig["ch_mult"]) - 1)
        if ckpt_path is not None:
            from ldm.checkpoint import load_first_stage  # the one weight-layout layer

            self.check_weights_file(ckpt_path, self.CKPT_PATH_KEY)
            load_first_stage(self, ckpt_path, ignore_keys)

    def check_weights_file(self, path, what: str) -> None:
        """A VAE of the other kind (`ldm.layout.family.vae_kind`: SD's 4-channel VAE with
        quant_conv, SD3's 16-channel one without) is one line naming both, before loading."""
        from ldm.checkpoint import WrongFileError
        from ldm.layout import family

        found = family.vae_kind(family.file_keys(path))
        expected = family.vae_kind(self.state_dict().keys())
        if found is not None and found != expected:
            raise WrongFileError(
                f"{what} {path} holds {found}, but the config builds {expected}; give "
                f"{family.VAE_KIND_FILES[expected]}, or the config of {found}"
            )

    def moments(self, x: torch.Tensor) -> torch.Tensor:
        """The posterior's stacked mean and log-variance (B, 2*embed_dim, H/f, W/f)."""
        moments = self.encoder(x)  # (B, 2*z_channels, H/f, W/f)
        return self.quant_conv(moments) if self.use_quant_conv else moments

    def encode(self, x: torch.Tensor) -> DiagonalGaussianDistribution:
        return DiagonalGaussianDistribution(self.moments(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.use_quant_conv:
            z = self.post_quant_conv(z)  # (B, z_channels, h, w)
        return self.decoder(z)  # (B, out_ch, h*f, w*f)

    def forward(
        self,
        x: torch.Tensor,
        sample_posterior: bool = True,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, DiagonalGaussianDistribution]:
        """Reconstruction (B, C, H, W) and the posterior, as the original forward."""
        posterior = self.encode(x)
        z = posterior.sample(generator) if sample_posterior else posterior.mode()
        return self.decode(z), posterior


def _checked_ddconfig(ddconfig) -> dict:
    """Refuse unknown or unsupported ddconfig values with the key's name, not a deep TypeError."""
    ddconfig = dict(ddconfig)
    unknown = sorted(set(ddconfig) - DDCONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"first_stage_config.params.ddconfig: unknown keys {unknown}; "
            f"expected some of {sorted(DDCONFIG_KEYS)}"
        )
    missing = sorted(REQUIRED_DDCONFIG_KEYS - set(ddconfig))
    if missing:
        raise ValueError(f"first_stage_config.params.ddconfig: missing keys {missing}")
    if not ddconfig.get("double_z", True):
        raise ValueError("first_stage_config.params.ddconfig.double_z must be true for a KL VAE")
    if ddconfig.get("attn_type", "vanilla") not in ATTN_TYPES:
        raise ValueError(
            f"first_stage_config.params.ddconfig.attn_type: '{ddconfig['attn_type']}' is not "
            f"supported; use one of {ATTN_TYPES}"
        )
    if ddconfig["ch"] % 32:
        raise ValueError(
            f"first_stage_config.params.ddconfig.ch={ddconfig['ch']}: must be a multiple of 32 "
            "(GroupNorm with 32 groups)"
        )
    ddconfig["ch_mult"] = tuple(ddconfig["ch_mult"])
    ddconfig["attn_resolutions"] = tuple(ddconfig.get("attn_resolutions", ()))
    ddconfig.setdefault("dropout", 0.0)
    return ddconfig


class PassThroughLatent:
    """The 'posterior' of IdentityFirstStage: sample() and mode() both return the input."""

    def __init__(self, x: torch.Tensor):
        self.mean = x

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.mean

    def mode(self) -> torch.Tensor:
        return self.mean


class IdentityFirstStage(nn.Module):
    """No autoencoder: diffusion runs in pixel space (tiny demos and tests). No parameters.

    Args:
        channels: image channels, which are then the latent channels (3 for RGB).
        vq_interface: accepted from the original configs; unused.
    """

    downscale = 1
    scale_factor, shift_factor = 1.0, 0.0  # pixels in [-1, 1] are the model's latents

    def __init__(self, channels: int = 3, vq_interface: bool = False):
        super().__init__()
        self.latent_channels = channels

    def encode(self, x: torch.Tensor) -> PassThroughLatent:
        return PassThroughLatent(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z
