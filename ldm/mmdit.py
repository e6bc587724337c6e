"""MMDiT: the backbone of Stable Diffusion 3 and 3.5 (Esser et al. 2024, arXiv:2403.03206).

A DiT whose text tokens are not read by cross-attention but travel through the network as a
second stream (sec. 4, fig. 2): every joint block holds two sets of weights, `context_block` for
the text tokens and `x_block` for the image patches, and one attention runs over the
concatenation of both, so each stream attends to itself and to the other ("joint attention").
Both streams are modulated by adaLN-Zero from c = timestep embedding + an MLP of the pooled CLIP
vector (DiT sec. 3.2). The last block's text stream only feeds keys and values to that block's
attention; its own output is never used, so it has no output projection, MLP or gates
("pre_only"). The patches get a 2-D sin-cos position table made for a larger canvas
(`pos_embed_max_size`) and cropped about its centre to the latent's size, so other aspect ratios
see the table's middle.

SD 3.5 adds RMSNorm of every head's queries and keys (`ln_q`, `ln_k`; sec. 5.3.2 "QK-
normalization", which keeps attention logits from growing in mixed precision), and 3.5 Medium
(MMDiT-X) gives the image stream of its first 13 blocks a second, image-only self-attention
(`x_block.attn2`) on the same normalised input, with its own shift, scale and gate.

Parameter names are those of Stability's single-file checkpoints under `model.diffusion_model.`
(Stability-AI/sd3.5 `mmditx.py`), so `sd3_medium()`, `sd35_medium()` and `sd35_large()` hold the
layout of `sd3_medium.safetensors`, `sd3.5_medium.safetensors` and `sd3.5_large.safetensors`, and
diffusers' own single-file converter reads our state dict (tests/ldm/test_mmdit.py).

FSDP: wrap `JointBlock` (one per depth step, both streams), e.g.
`ModuleWrapPolicy({JointBlock})`; it is also the gradient-checkpointing unit.
"""

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ldm.config_errors import check_whole_numbers
from ldm.dit import FinalLayer, Mlp, PatchEmbed, TimestepEmbedder, layer_norm, modulate

HEAD_DIM = 64  # SD3's rule: hidden = 64 * depth, heads = depth (mmditx.py "apply magic")
CONTEXT_DIM = 4096  # text tokens: CLIP-L ++ bigG (768 + 1280, zero-padded to 4096) then T5-XXL
POOLED_DIM = 2048  # pooled CLIP-L (768) ++ pooled bigG (1280)
SD35_MEDIUM_DUAL_ATTENTION_LAYERS = tuple(range(13))  # MMDiT-X: attn2 in blocks 0..12


def sd3_pos_embed(dim: int, max_size: int, base_size: int) -> torch.Tensor:
    """The (max_size ** 2, dim) sin-cos table of SD3, rows in raster order.

    As DiT's table (first half of the channels the column, second half the row, each
    [sin | cos] over frequencies 10000^(-i / (dim / 4))), but positions are counted in units of
    the training grid: position i of the max_size canvas is i * base_size / max_size, so a
    `base_size` grid spans the same range as the whole canvas (diffusers' `PatchEmbed` with
    `base_size = sample_size // patch_size`). Released files carry their own table, which
    loading them replaces.
    """
    if dim % 4:
        raise ValueError(f"the 2-D sin-cos embedding needs a width divisible by 4, got {dim}")
    positions = torch.arange(max_size, dtype=torch.float32) / (max_size / base_size)  # (S,)
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))  # (D/4,)
    args = positions.double()[:, None] * omega[None]  # (S, D/4)
    # One row per position, then broadcast: the full table in float64 would be ~2 GB at 384^2.
    embed = torch.cat([torch.sin(args), torch.cos(args)], dim=1).float()  # (S, D/2)
    cols = embed[None].expand(max_size, -1, -1)  # (S rows, S cols, D/2), varies along cols
    rows = embed[:, None].expand(-1, max_size, -1)
    return torch.cat([cols, rows], dim=2).reshape(max_size * max_size, dim)  # (S*S, D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v (B, N, heads, D/heads) -> (B, N, D): softmax(q k^T / sqrt(d)) v on SDPA.

    Token-major on both sides: SDPA takes the (B, heads, N, D/heads) views as they are (its CPU
    and CUDA kernels work in this layout) and returns its output in it, so neither the inputs
    nor the output are copied to change layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    b, _, n, _ = out.shape
    return out.transpose(1, 2).reshape(b, n, -1)


class _RMSNormFunction(torch.autograd.Function):
    """y = x / rms(x) * w over the last dim, with a backward that needs only x / rms(x) and
    1 / rms(x), not x.

    torch's own RMSNorm keeps its input for the backward (and the normalised x as well, where
    autograd composes it from elementwise ops, as on a CPU). Here the input is a view of the
    fused q, k, v projection, so keeping it would keep all three alive (v too) until the
    backward; the normalised q and k alone are enough (with n = normalised, g = dy * w:
    dx = (g - n * mean(g * n)) / rms(x), dw = sum(dy * n)). The same forward ops as
    `torch.nn.functional.rms_norm`: half inputs are normalised in float32 and the result cast
    back; the normalised q and k are kept in float32 too, so the gradients are those of torch's
    (which keeps a float32 copy of the input and the float32 normalised values).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        inv_rms = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        normed = wide * inv_rms
        ctx.save_for_backward(normed, inv_rms, weight)
        ctx.input_dtype = x.dtype
        return (normed * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, inv_rms, weight = ctx.saved_tensors
        grad = grad.to(normed.dtype)
        grad_weight = (grad * normed).flatten(0, -2).sum(0).to(weight.dtype)
        g = grad * weight
        grad_x = inv_rms * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(ctx.input_dtype), grad_weight, None


class QKNorm(nn.RMSNorm):
    """SD 3.5's per-head RMSNorm of queries and keys (an `nn.RMSNorm`: same weight, same math)
    whose backward keeps the normalised output, not the input (`_RMSNormFunction`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm's default
        return _RMSNormFunction.apply(x, self.weight, eps)


class SelfAttention(nn.Module):
    """One stream's attention weights: `qkv`, the optional per-head RMSNorm of q and k (SD 3.5)
    and the output projection `proj`, which a pre_only stream does not have."""

    def __init__(self, hidden_size: int, num_heads: int, qk_norm: bool, pre_only: bool = False):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        # RMSNorm over each head's channels, with a learned scale (eps 1e-6 as mmditx.py).
        self.ln_q = QKNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.ln_k = QKNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        if not pre_only:
            self.proj = nn.Linear(hidden_size, hidden_size)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, N, D) -> q, k, v, each (B, N, heads, D/heads); q and k normalised."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).unbind(2)
        return self.ln_q(q), self.ln_k(k), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Plain self-attention of one stream (MMDiT-X's `attn2`): (B, N, D) -> (B, N, D)."""
        return self.proj(attention(*self.heads(x)))


class StreamBlock(nn.Module):
    """One stream's half of a joint block: a DiT block whose attention is cut in two, so the
    joint block can run one attention over both streams' q, k, v in between.

    adaLN-Zero chunks, in this order: shift, scale, gate for the attention, shift, scale, gate
    for the MLP, then (MMDiT-X) shift, scale, gate for `attn2`; a pre_only stream has only the
    attention's shift and scale.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        qk_norm: bool,
        pre_only: bool = False,
        self_attention: bool = False,
    ):
        super().__init__()
        if pre_only and self_attention:
            raise ValueError("a pre_only stream has no output, so it cannot have attn2")
        self.pre_only = pre_only
        self.norm1 = layer_norm(hidden_size)
        self.attn = SelfAttention(hidden_size, num_heads, qk_norm, pre_only)
        if self_attention:
            self.attn2 = SelfAttention(hidden_size, num_heads, qk_norm)
        if not pre_only:
            self.norm2 = layer_norm(hidden_size)
            self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.num_modulations = 2 if pre_only else 9 if self_attention else 6
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), nn.Linear(hidden_size, self.num_modulations * hidden_size)
        )

    def pre_attention(self, x: torch.Tensor, c: torch.Tensor):
        """x (B, N, D), c (B, D) -> (q, k, v) each (B, N, heads, D/heads), and what
        post_attention needs: the normalised x and the modulations (each (B, D))."""
        modulations = self.adaLN_modulation(c).chunk(self.num_modulations, dim=1)
        shift_msa, scale_msa = modulations[:2]
        normed = self.norm1(x)  # computed once: MMDiT-X's attn2 reads it too
        return self.attn.heads(modulate(normed, shift_msa, scale_msa)), normed, modulations

    def post_attention(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        attn_out: torch.Tensor,
        modulations: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """x (B, N, D) the stream's input, normed its norm1, attn_out (B, N, D) its rows of the
        joint attention -> (B, N, D): the gated attention and (MMDiT-X) attn2 residuals, then
        the gated MLP."""
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp, *second = modulations
        x = x + gate_msa.unsqueeze(1) * self.attn.proj(attn_out)
        if second:  # MMDiT-X: image-only attention on the same normalised input
            shift_msa2, scale_msa2, gate_msa2 = second
            x = x + gate_msa2.unsqueeze(1) * self.attn2(modulate(normed, shift_msa2, scale_msa2))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class JointBlock(nn.Module):
    """Text stream + image stream around one joint attention (paper fig. 2b). The FSDP and
    gradient-checkpointing unit."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        qk_norm: bool,
        pre_only: bool,
        self_attention: bool,
    ):
        super().__init__()
        self.context_block = StreamBlock(hidden_size, num_heads, mlp_ratio, qk_norm, pre_only)
        self.x_block = StreamBlock(
            hidden_size, num_heads, mlp_ratio, qk_norm, self_attention=self_attention
        )

    def forward(
        self, context: torch.Tensor, x: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """context (B, T, D) text tokens, x (B, N, D) image tokens, c (B, D) -> (context or
        None after the pre_only block, x)."""
        context_qkv, context_normed, context_mods = self.context_block.pre_attention(context, c)
        x_qkv, x_normed, x_mods = self.x_block.pre_attention(x, c)
        # One attention over [text; image]: (B, T + N, heads, D/heads) for q, k and v.
        q, k, v = (torch.cat(pair, dim=1) for pair in zip(context_qkv, x_qkv, strict=True))
        out = attention(q, k, v)  # (B, T + N, D)
        context_out, x_out = out.split([context.shape[1], x.shape[1]], dim=1)
        x = self.x_block.post_attention(x, x_normed, x_out, x_mods)
        if self.context_block.pre_only:
            return None, x
        context = self.context_block.post_attention(
            context, context_normed, context_out, context_mods
        )
        return context, x


class VectorEmbedder(nn.Module):
    """Pooled text vector (B, pooled_dim) -> (B, D): Linear, SiLU, Linear."""

    def __init__(self, in_features: int, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_features, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.mlp(y)


class MMDiT(nn.Module):
    """The SD 3 / 3.5 diffusion transformer (Stability's `model.diffusion_model` names).

    Args:
        depth: number of joint blocks; by SD3's rule it also sets the width (64 * depth) and the
            heads (depth) unless `hidden_size` / `num_heads` are given (tiny test models).
        patch_size: p, the side of a patch in latent pixels (2).
        in_channels, out_channels: latent channels (16, the SD3 VAE); out defaults to in.
        mlp_ratio: MLP width over the model width (4).
        context_dim: width of the text tokens `cond["crossattn"]` (4096).
        pooled_dim: width of the pooled text vector `cond["vector"]` (2048).
        pos_embed_max_size: side, in patches, of the stored position table (192; 384 for 3.5
            Medium); latents up to p * that side run, each cropping the table's centre.
        sample_size: the latent side the model was trained at (128 = 1024 px); it sets the
            position scale of a new table and `image_size` for LatentDiffusion.
        qk_norm: RMSNorm of queries and keys (SD 3.5).
        dual_attention_layers: the blocks whose image stream has `attn2` (3.5 Medium: 0..12).
        use_checkpoint: gradient checkpointing of every joint block while training.
    """

    # The config key that sets each conditioning field's width (ldm.conditioning's check).
    field_keys = {"crossattn": "context_dim", "vector": "pooled_dim"}

    def __init__(
        self,
        depth: int = 24,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float = 4.0,
        context_dim: int = CONTEXT_DIM,
        pooled_dim: int = POOLED_DIM,
        pos_embed_max_size: int = 192,
        sample_size: int = 128,
        qk_norm: bool = False,
        dual_attention_layers: Sequence[int] = (),
        use_checkpoint: bool = False,
    ):
        super().__init__()
        hidden_size = hidden_size or HEAD_DIM * depth
        num_heads = num_heads or depth
        check_whole_numbers(
            depth=depth,
            patch_size=patch_size,
            in_channels=in_channels,
            hidden_size=hidden_size,
            num_heads=num_heads,
            context_dim=context_dim,
            pooled_dim=pooled_dim,
            pos_embed_max_size=pos_embed_max_size,
            sample_size=sample_size,
        )
        if any(not 0 <= i < depth - 1 for i in dual_attention_layers):
            raise ValueError(
                f"dual_attention_layers {list(dual_attention_layers)} must name blocks 0..{depth - 2}"
            )
        # Geometry read by LatentDiffusion.
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.patch_size = self.size_multiple = patch_size
        self.image_size = sample_size
        self.learn_sigma = False
        self.pos_embed_max_size = pos_embed_max_size
        self.max_latent_side = pos_embed_max_size * patch_size  # the position table's reach
        self.use_checkpoint = use_checkpoint

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.field_widths = {"crossattn": context_dim, "vector": pooled_dim}
        self.y_embedder = VectorEmbedder(pooled_dim, hidden_size)
        self.context_embedder = nn.Linear(context_dim, hidden_size)
        # A buffer, as in mmditx.py: fixed, but saved in (and loaded from) the checkpoint.
        self.register_buffer(
            "pos_embed",
            sd3_pos_embed(hidden_size, pos_embed_max_size, sample_size // patch_size)[None],
        )  # (1, S*S, D)
        self.joint_blocks = nn.ModuleList(
            JointBlock(
                hidden_size,
                num_heads,
                mlp_ratio,
                qk_norm,
                pre_only=i == depth - 1,
                self_attention=i in dual_attention_layers,
            )
            for i in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's initialisation (Xavier-uniform linears, N(0, 0.02) timestep MLP), with every
        adaLN modulation and the output layer at zero so each block starts as the identity
        (adaLN-Zero). Stability released no training code; fine-tuning loads real weights."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        zero = [m.adaLN_modulation[-1] for b in self.joint_blocks for m in b.children()]
        for layer in [*zero, self.final_layer.adaLN_modulation[-1], self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each joint block's activations in the backward pass (training only)."""
        self.use_checkpoint = enabled

    def cropped_pos_embed(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """(1, grid_h * grid_w, D): the centre of the stored (S x S) table."""
        size = self.pos_embed_max_size
        if grid_h > size or grid_w > size:
            raise ValueError(
                f"a {grid_h}x{grid_w}-patch latent is larger than this model's position table "
                f"({size}x{size} patches); use a latent of at most {size * self.patch_size} "
                "pixels a side"
            )
        top, left = (size - grid_h) // 2, (size - grid_w) // 2
        table = self.pos_embed.view(1, size, size, -1)[:, top : top + grid_h, left : left + grid_w]
        return table.reshape(1, grid_h * grid_w, -1)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, N, p*p*C_out) -> (B, C_out, H, W); token n is patch (n // (W/p), n % (W/p)) and
        holds its pixels in (p_row, p_col, channel) order."""
        p, c = self.patch_size, self.out_channels
        x = x.reshape(x.shape[0], h // p, w // p, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h, w)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """x (B, C, H, W) latent, t (B,) timesteps on SD3's 0..1000 scale (sigma * 1000),
        cond["crossattn"] (B, T, context_dim) text tokens, cond["vector"] (B, pooled_dim) pooled
        text -> (B, C_out, H, W), the velocity e - x_0 of rectified flow."""
        missing = [key for key in ("crossattn", "vector") if key not in cond]
        if missing:
            raise ValueError(
                f"MMDiT needs cond {missing}: the text tokens ('crossattn') and the pooled "
                "text vector ('vector')"
            )
        h, w = x.shape[-2:]
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"latent sides {h}x{w} must be multiples of the patch size {p}")
        tokens = self.x_embedder(x) + self.cropped_pos_embed(h // p, w // p)  # (B, N, D)
        dtype = tokens.dtype
        c = self.t_embedder(t) + self.y_embedder(cond["vector"].to(dtype))  # (B, D)
        context = self.context_embedder(cond["crossattn"].to(dtype))  # (B, T, D)
        for block in self.joint_blocks:
            if self.use_checkpoint and self.training and torch.is_grad_enabled():
                context, tokens = checkpoint(block, context, tokens, c, use_reentrant=False)
            else:
                context, tokens = block(context, tokens, c)  # (B, T, D) or None, (B, N, D)
        tokens = self.final_layer(tokens, c)  # (B, N, p*p*C_out)
        return self.unpatchify(tokens, h, w)  # (B, C_out, H, W)

    def blocks_in_order(self) -> list[nn.Module]:
        """The blocks base quantization and block swap act on (ldm.block_swap.blocks_of), in
        the order they run. Left as they are: the patch, timestep, pooled-vector and context
        embedders, and the final layer."""
        return list(self.joint_blocks)


# --- presets (the released checkpoints' sizes; diffusers' configs of the same models) ---------


def sd3_medium(**kwargs) -> MMDiT:
    """Stable Diffusion 3 Medium (2B): 24 blocks, width 1536, 24 heads, 192^2 table."""
    return MMDiT(depth=24, pos_embed_max_size=192, **kwargs)


def sd35_medium(**kwargs) -> MMDiT:
    """Stable Diffusion 3.5 Medium (MMDiT-X, 2.5B): as SD3 Medium plus QK RMSNorm, attn2 in
    blocks 0..12, and a 384^2 table."""
    return MMDiT(
        depth=24,
        pos_embed_max_size=384,
        qk_norm=True,
        dual_attention_layers=SD35_MEDIUM_DUAL_ATTENTION_LAYERS,
        **kwargs,
    )


def sd35_large(**kwargs) -> MMDiT:
    """Stable Diffusion 3.5 Large (8B): 38 blocks, width 2432, 38 heads, QK RMSNorm."""
    return MMDiT(depth=38, pos_embed_max_size=192, qk_norm=True, **kwargs)


# The Linear layers of a joint block LoRA adapts (issue 33 item 6): the attention and MLP of both
# streams and MMDiT-X's attn2; not the adaLN modulation (diffusers swaps its shift / scale halves).
LORA_LAYERS = re.compile(
    r"joint_blocks\.\d+\.(x_block|context_block)\.(attn|attn2)\.(qkv|proj)"
    r"|joint_blocks\.\d+\.(x_block|context_block)\.mlp\.fc[12]"
)


def lora_targets(model: MMDiT) -> list[str]:
    """Names (in `model`) of the Linear layers LoRA adapts, in module order: per joint block and
    stream `attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2` (a pre_only context stream has only
    `attn.qkv`) and MMDiT-X's `attn2.qkv` / `attn2.proj`."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and LORA_LAYERS.fullmatch(name)
    ]
