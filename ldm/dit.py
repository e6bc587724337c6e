"""DiT: Diffusion Transformers with adaLN-Zero blocks (Peebles & Xie 2023, arXiv:2212.09748).

The latent is cut into p x p patches, each a token; a fixed 2-D sin-cos table gives the tokens
their positions; N transformer blocks are conditioned on the timestep + class embedding through
adaptive layer norm whose gates start at zero (adaLN-Zero, sec. 3.2: each block starts as the
identity); a final adaLN layer projects every token back to a p x p x C patch. Parameter names
follow facebookresearch/DiT `models.py`, so the released `DiT-XL-2-256x256.pt` loads strictly
into `DiT_XL_2(input_size=32)`.

The text-conditional variant (PixArt-alpha style) is `ldm.dit_text.TextDiT`; it shares the parts
below.
"""

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ldm.unet import timestep_embedding

FREQUENCY_EMBEDDING_SIZE = 256  # sinusoid width before the timestep MLP (DiT's default)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x (B, N, D) normalised, then scaled by 1 + scale and shifted, per sample (B, D).

    One addcmul (shift + x * (1 + scale)) instead of a multiply and an add: one pass over x and
    no (B, N, D) temporary; autograd keeps the same tensors (x and 1 + scale)."""
    return torch.addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1))


def sincos_pos_embed_2d(dim: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position table (grid_h * grid_w, dim), rows in raster order.

    As DiT's (MAE's) `get_2d_sincos_pos_embed`: the first half of the channels encodes the column
    and the second half the row, each as [sin | cos] over frequencies 10000^(-i / (dim / 4)).
    Computed in float64 like the original's numpy code, so the released pos_embed is reproduced.
    """
    if dim % 4:
        raise ValueError(f"the 2-D sin-cos embedding needs a width divisible by 4, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))  # (D/4,)
    rows, cols = torch.meshgrid(
        torch.arange(grid_h, dtype=torch.float64),
        torch.arange(grid_w, dtype=torch.float64),
        indexing="ij",
    )

    def embed_1d(pos: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D/2)
        args = pos.reshape(-1, 1) * omega[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=1)

    return torch.cat([embed_1d(cols), embed_1d(rows)], dim=1).float()  # (H*W, D)


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, H/p * W/p, D): a stride-p convolution, one token per patch."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous: (B, D, N) read as (B, N, D) is a transposed view, and elementwise ops keep
        # their first input's strides, so `x + gate * ...` would carry that channel-major layout
        # through every block (each LayerNorm copying it, every residual add strided).
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # (B, N, D)


class TimestepEmbedder(nn.Module):
    """Timesteps (B,) -> (B, D): 256 sinusoids ([cos | sin], as the UNet's), then a 2-layer MLP."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        frequencies = timestep_embedding(t, FREQUENCY_EMBEDDING_SIZE)  # (B, 256) float32
        return self.mlp(frequencies.to(self.mlp[0].weight.dtype))  # (B, D)


class LabelEmbedder(nn.Module):
    """Class ids (B,) -> (B, D). Row `num_classes` is the null class of classifier-free guidance;
    which labels are dropped to it while training is the conditioner's choice
    (`ldm.conditioning.ClassLabels.ucg_rate`), not this table's."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels)


class Attention(nn.Module):
    """Multi-head self-attention on SDPA; q, k, v from one `qkv` projection (timm's layout)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, N, D/heads)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))  # (B, N, D)


class Mlp(nn.Module):
    """Linear -> GELU (tanh approximation, as DiT) -> Linear."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features or in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def layer_norm(hidden_size: int) -> nn.LayerNorm:
    """LayerNorm without affine weights: adaLN supplies the scale and shift."""
    return nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)


class DiTBlock(nn.Module):
    """Self-attention + MLP, each modulated by (shift, scale) and gated, from the conditioning
    vector c (DiT sec. 3.2, "adaLN-Zero"). The FSDP and checkpointing unit."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = layer_norm(hidden_size)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = layer_norm(hidden_size)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)  # each (B, D)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x  # (B, N, D)


class FinalLayer(nn.Module):
    """adaLN (shift, scale; no gate) then a linear map of every token to a p x p x C_out patch."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = layer_norm(hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, p*p*C_out)


class PatchTransformer(nn.Module):
    """What DiT and its text variant share: patchify with fixed positions, run the blocks
    (checkpointed on request), unpatchify. Subclasses build `blocks` and `final_layer`.

    Geometry for `LatentDiffusion`: `in_channels`, `out_channels`, `size_multiple` (= patch
    size), `image_size` (the latent side the position table was made for), `learn_sigma`; and
    `field_widths`, the width of each conditioning field a subclass reads.
    """

    def __init__(
        self,
        input_size: int,
        patch_size: int,
        in_channels: int,
        hidden_size: int,
        learn_sigma: bool,
        use_checkpoint: bool,
    ):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(
                f"input_size {input_size} is not a multiple of patch_size {patch_size}"
            )
        self.in_channels, self.patch_size = in_channels, patch_size
        self.image_size, self.size_multiple = input_size, patch_size
        # learn_sigma: the second half of the channels is the variance interpolation v of
        # Improved DDPM (Nichol & Dhariwal 2021, eq. 15), trained with the VLB (ldm.vlb).
        self.learn_sigma = learn_sigma
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.use_checkpoint = use_checkpoint
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        grid = input_size // patch_size
        # A parameter that is never trained (as in DiT), so it is in the state dict and the
        # released files; refilled with the fixed table in initialize_weights.
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid, hidden_size), requires_grad=False)

    def initialize_weights(self) -> None:
        """DiT's initialisation (models.py `initialize_weights`): Xavier-uniform linears, the
        patch projection like a linear, N(0, 0.02) embeddings, and zero for every adaLN
        modulation and the output layer, so each block starts as the identity (adaLN-Zero)."""

        def xavier(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(xavier)
        grid = int(math.isqrt(self.pos_embed.shape[1]))
        self.pos_embed.data.copy_(sincos_pos_embed_2d(self.pos_embed.shape[-1], grid, grid)[None])
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.data.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for modulation in self.zero_init_layers():
            nn.init.zeros_(modulation.weight)
            nn.init.zeros_(modulation.bias)

    def zero_init_layers(self) -> list[nn.Linear]:
        """The layers that start at zero (subclasses: the modulations and the output)."""
        raise NotImplementedError

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in the backward pass (training only)."""
        self.use_checkpoint = enabled

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """(1, N, D) position table: the stored one at the native size, computed otherwise."""
        if grid_h * grid_w == self.pos_embed.shape[1] and grid_h == grid_w:
            return self.pos_embed
        table = sincos_pos_embed_2d(self.pos_embed.shape[-1], grid_h, grid_w)
        return table[None].to(self.pos_embed)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) latent -> (B, N, D) tokens with positions."""
        h, w = x.shape[-2:]
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(
                f"latent sides {h}x{w} must be multiples of the patch size {self.patch_size}"
            )
        tokens = self.x_embedder(x)  # (B, N, D)
        return tokens + self.positions(h // self.patch_size, w // self.patch_size)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, N, p*p*C_out) -> (B, C_out, H, W); token n is patch (n // (W/p), n % (W/p)) and
        holds its pixels in (p_row, p_col, channel) order."""
        p, c = self.patch_size, self.out_channels
        gh, gw = h // p, w // p
        x = x.reshape(x.shape[0], gh, gw, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, gh * p, gw * p)

    def run_block(self, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        if self.use_checkpoint and self.training and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def blocks_in_order(self) -> list[nn.Module]:
        """The blocks base quantization and block swap act on (ldm.block_swap.blocks_of), in
        the order they run. Left as they are: the patch, timestep and label / text embedders,
        PixArt's shared `t_block`, and the final layer."""
        return list(self.blocks)


class DiT(PatchTransformer):
    """Class-conditional DiT (facebookresearch/DiT names).

    Args:
        input_size: latent side the model is made for (32 for 256 px images with the SD VAE);
            other sizes that are multiples of `patch_size` also run (positions are recomputed).
        patch_size: p, the side of a patch in latent pixels (2, 4 or 8).
        in_channels: latent channels (4).
        hidden_size, depth, num_heads, mlp_ratio: the transformer (see the presets below).
        num_classes: real classes; the embedding table has one more row, the null class.
        learn_sigma: output 2 x in_channels (eps and the learned variance), as the released DiT.
        use_checkpoint: gradient checkpointing of every block while training.
    """

    # The config key that sets each conditioning field's width (ldm.conditioning's check).
    field_keys = {"y": "num_classes"}

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        use_checkpoint: bool = False,
    ):
        super().__init__(
            input_size, patch_size, in_channels, hidden_size, learn_sigma, use_checkpoint
        )
        self.num_classes = num_classes
        self.field_widths = {"y": num_classes}  # what the conditioner must make (the class count)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        super().initialize_weights()
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)

    def zero_init_layers(self) -> list[nn.Linear]:
        """adaLN-Zero: every modulation and the output projection start at zero."""
        layers = [block.adaLN_modulation[-1] for block in self.blocks]
        return layers + [self.final_layer.adaLN_modulation[-1], self.final_layer.linear]

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """x (B, C, H, W) latent, t (B,) timesteps, cond["y"] (B,) class ids (num_classes = null)
        -> (B, C_out, H, W): eps, then (learn_sigma) the variance interpolation."""
        if "y" not in cond:
            raise ValueError(
                "DiT is class-conditional: cond needs 'y' (ldm.conditioning.ClassLabels)"
            )
        h, w = x.shape[-2:]
        tokens = self.patchify(x)  # (B, N, D)
        c = self.t_embedder(t) + self.y_embedder(cond["y"])  # (B, D)
        for block in self.blocks:
            tokens = self.run_block(block, tokens, c)  # (B, N, D)
        tokens = self.final_layer(tokens, c)  # (B, N, p*p*C_out)
        return self.unpatchify(tokens, h, w)  # (B, C_out, H, W)


# --- presets (DiT table 1; "/p" = patch size) -----------------------------------------------


def DiT_XL_2(**kwargs) -> DiT:
    return DiT(depth=28, hidden_size=1152, patch_size=2, num_heads=16, **kwargs)


def DiT_XL_4(**kwargs) -> DiT:
    return DiT(depth=28, hidden_size=1152, patch_size=4, num_heads=16, **kwargs)


def DiT_XL_8(**kwargs) -> DiT:
    return DiT(depth=28, hidden_size=1152, patch_size=8, num_heads=16, **kwargs)


def DiT_L_2(**kwargs) -> DiT:
    return DiT(depth=24, hidden_size=1024, patch_size=2, num_heads=16, **kwargs)


def DiT_L_4(**kwargs) -> DiT:
    return DiT(depth=24, hidden_size=1024, patch_size=4, num_heads=16, **kwargs)


def DiT_L_8(**kwargs) -> DiT:
    return DiT(depth=24, hidden_size=1024, patch_size=8, num_heads=16, **kwargs)


def DiT_B_2(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=768, patch_size=2, num_heads=12, **kwargs)


def DiT_B_4(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=768, patch_size=4, num_heads=12, **kwargs)


def DiT_B_8(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=768, patch_size=8, num_heads=12, **kwargs)


def DiT_S_2(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=384, patch_size=2, num_heads=6, **kwargs)


def DiT_S_4(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=384, patch_size=4, num_heads=6, **kwargs)


def DiT_S_8(**kwargs) -> DiT:
    return DiT(depth=12, hidden_size=384, patch_size=8, num_heads=6, **kwargs)


# The original repository's names ("DiT-XL/2"), as its train.py / sample.py take them.
DiT_models = {
    f"DiT-{size}/{p}": globals()[f"DiT_{size}_{p}"]
    for size in ("XL", "L", "B", "S")
    for p in (2, 4, 8)
}
