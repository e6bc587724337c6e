"""Flux.1: the rectified-flow transformer of Black Forest Labs (dev and schnell, 12B).

An MMDiT (Esser et al. 2024, arXiv:2403.03206; see ldm.mmdit) in two parts. The first 19
"double-stream" blocks keep separate weights for the text tokens (`txt_*`) and the image patches
(`img_*`) around one joint attention, as SD3's joint blocks do. Then both streams are
concatenated and 38 "single-stream" blocks run on the joint sequence, each a parallel block
(Dehghani et al. 2023, arXiv:2302.05442, "ViT-22B"): one `linear1` makes q, k, v and the MLP's
hidden layer from the same modulated input, one `linear2` maps [attention | GELU(mlp)] back.

Positions are not added to the tokens: every attention rotates q and k (RoPE, Su et al. 2021,
arXiv:2104.09864) by a 3-axis position id per token, (0, row, column) for image patches and
(0, 0, 0) for text tokens, the head's 128 channels split 16 / 56 / 56 between the axes. Queries
and keys are RMS-normalised per head before the rotation (QK-norm). Every block is modulated from
one vector = MLP(timestep) + MLP(pooled CLIP-L) (+ MLP(guidance scale) in dev, which was
distilled from classifier-free guidance and takes the guidance scale as an input).

The latent (16 channels) is cut into 2x2 patches, each flattened channel-major ((c, ph, pw), 64
values) and mapped by a linear layer `img_in`. Parameter names are those of BFL's
`flux1-dev.safetensors` / `flux1-schnell.safetensors` (black-forest-labs/flux
`src/flux/model.py`), so diffusers' single-file converter reads our state dict
(tests/ldm/test_flux.py); file prefixes live in ldm.layout.flux.

FSDP: wrap `DoubleStreamBlock` and `SingleStreamBlock`; they are also the gradient-checkpointing
units.
"""

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ldm.config_errors import check_whole_numbers
from ldm.dit import FinalLayer, layer_norm
from ldm.flow import dynamic_shift
from ldm.unet import timestep_embedding

CONTEXT_DIM = 4096  # T5-XXL token width
POOLED_DIM = 768  # pooled CLIP-L
AXES_DIM = (16, 56, 56)  # RoPE channels per position axis: (text/index, row, column)
THETA = 10_000
FREQUENCY_EMBEDDING_SIZE = 256  # sinusoids of the timestep and the guidance scale
GUIDANCE_SCALE_FACTOR = 1000.0  # BFL embeds guidance * 1000, as the timestep (t in [0, 1] * 1000)


# --- the image-size-dependent time shift (BFL src/flux/sampling.py get_schedule) --------------


def flux_shift(image_seq_len: int, **kwargs) -> float:
    """The `shift` of ldm.flow for an image of `image_seq_len` tokens: BFL's time_shift
    exp(mu) / (exp(mu) + (1 / t - 1)) equals ldm.flow.shift_time(t, exp(mu)) = s t / (1 + (s - 1) t).
    Larger images are shifted towards noise (SD3 sec. 5.3.2); 1024 px gives exp(1.15) ~ 3.16.
    The rule is `ldm.flow.dynamic_shift` (its keyword arguments: the line's two points), which
    a flow schedule applies per batch with `use_dynamic_shifting: true`."""
    return dynamic_shift(image_seq_len, **kwargs)


def image_seq_len(height: int, width: int, patch_size: int = 2) -> int:
    """Tokens of a latent of height x width latent pixels."""
    return (height // patch_size) * (width // patch_size)


# --- rotary position embedding over 3 axes -----------------------------------------------------


def rope(ids: torch.Tensor, axes_dim: Sequence[int], theta: float) -> torch.Tensor:
    """Position ids (B, L, n_axes) -> rotations (B, L, 1, head_dim / 2), complex64: e^(i angle).

    Axis i takes axes_dim[i] channels, i.e. axes_dim[i] / 2 rotation planes, plane j turning by
    position * theta^(-2j / axes_dim[i]) (RoPE eq. 15); the planes of all axes are concatenated.
    Channels (2j, 2j + 1) of a head are plane j, read as the complex number x_2j + i x_2j+1, so
    the rotation by angle_j is one complex product (RoPE sec. 3.4.2; BFL's 2x2 matrices
    [[cos, -sin], [sin, cos]] per plane are the same map). Laid out token-major, a size-1 head
    axis, to multiply (B, L, heads, head_dim / 2) queries and keys. Angles in float64
    (positions up to a few hundred times the fastest frequency), the rotations complex64.
    """
    angles = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (
            torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim
        )
        angles.append(ids[..., axis].double()[..., None] * omega)  # (B, L, dim / 2)
    angle = torch.cat(angles, dim=-1)  # (B, L, head_dim / 2)
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64).unsqueeze(2)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, head_dim) -> x with channel pairs (2j, 2j + 1) rotated by plane j's angle:
    (x_2j cos - x_2j+1 sin, x_2j+1 cos + x_2j sin), in float32 (BFL's apply_rope), as
    (x_2j + i x_2j+1) e^(i angle): one complex multiply forward and one backward, where the real
    form takes a pair swap (a copy) and four passes over x. `view_as_complex` needs a last
    stride of 1 (QK-norm's output is a fresh tensor)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, L, heads, D / 2)
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor, q_start: int = 0
) -> torch.Tensor:
    """q (B, Lq, heads, head_dim), k, v (B, L, heads, head_dim) -> (B, Lq, heads * head_dim), q
    and k rotated first. q holds the queries of rows q_start .. L of the sequence (all by
    default), so it takes those rows' rotations.

    Token-major (as ldm.mmdit): the double block's [text; image] concatenation is a plain copy,
    SDPA takes the (B, heads, L, head_dim) views as they are, and its output comes back in
    token-major layout, so no layout copy before the projection (BFL's rearrange
    "B L (K H D) -> K B H L D" and "B H L D -> B L (H D)" copy both ways)."""
    q, k = apply_rope(q, rotation[:, q_start:]), apply_rope(k, rotation)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    b, _, length, _ = out.shape
    return out.transpose(1, 2).reshape(b, length, -1)


# --- layers -------------------------------------------------------------------------------------


class MLPEmbedder(nn.Module):
    """(B, in) -> (B, D): `in_layer`, SiLU, `out_layer` (timestep, guidance and pooled text)."""

    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_size)
        self.out_layer = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) over a head's channels, in float32, learned `scale`
    (BFL's parameter name; torch.nn.RMSNorm would call it `weight`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6)  # x / sqrt(mean(x^2) + eps)
        return normed.to(x.dtype) * self.scale


class QKNorm(nn.Module):
    """Per-head RMSNorm of queries and keys (keeps attention logits bounded in bf16)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = RMSNorm(head_dim)
        self.key_norm = RMSNorm(head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


def split_heads(qkv: torch.Tensor, num_heads: int):
    """(B, L, 3 D) laid out (q | k | v, each heads x head_dim) -> q, k, v (B, L, heads, D/heads),
    views (token-major: no copy)."""
    b, length, _ = qkv.shape
    return qkv.view(b, length, 3, num_heads, -1).unbind(2)


class SelfAttention(nn.Module):
    """One stream's attention weights in a double block: `qkv`, `norm` (QK-norm), `proj`."""

    def __init__(self, hidden_size: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=qkv_bias)
        self.norm = QKNorm(hidden_size // num_heads)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def heads(self, x: torch.Tensor):
        """x (B, L, D) modulated -> q, k, v (B, L, heads, D/heads), q and k normalised."""
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        q, k = self.norm(q, k, v)
        return q, k, v


class Modulation(nn.Module):
    """vec (B, D) -> `count` chunks (B, 1, D) of SiLU -> `lin`: (shift, scale, gate) per sub-block
    (one for a single block, attention and MLP for a double block)."""

    def __init__(self, hidden_size: int, count: int):
        super().__init__()
        self.count = count
        self.lin = nn.Linear(hidden_size, count * hidden_size)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None].chunk(self.count, dim=-1)


def mlp(hidden_size: int, mlp_ratio: float) -> nn.Sequential:
    """Linear -> GELU(tanh) -> Linear, as a Sequential so the keys are `*_mlp.0` / `*_mlp.2`."""
    width = int(hidden_size * mlp_ratio)
    return nn.Sequential(
        nn.Linear(hidden_size, width), nn.GELU(approximate="tanh"), nn.Linear(width, hidden_size)
    )


def shifted_norm(
    norm: nn.LayerNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """adaLN with (B, 1, D) modulations: norm(x) (1 + scale) + shift. With one modulation for
    the batch (B = 1, Flux's usual training batch) that is the LayerNorm's own affine map,
    weight 1 + scale and bias shift: one kernel forward and one backward (which sums the weight
    and bias gradients in the same pass), where a separate addcmul costs a pass over x forward
    and three backward. The same products, the values agree to the bit. (Modulations of
    another dtype than x keep the addcmul and its type promotion.)"""
    if shift.shape[0] == 1 and shift.dtype == x.dtype:
        weight, bias = (1 + scale).view(-1), shift.view(-1)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
    return torch.addcmul(shift, norm(x), 1 + scale)  # one pass over x


def gated(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The gated residual x + gate * out, gate (B, 1, D), in one pass (addcmul)."""
    return torch.addcmul(x, gate, out)


class DoubleStreamBlock(nn.Module):
    """Text and image stream, each a DiT block, around one attention over [text; image]."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = True):
        super().__init__()
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_mod", Modulation(hidden_size, 6))
            setattr(self, f"{stream}_norm1", layer_norm(hidden_size))
            setattr(self, f"{stream}_attn", SelfAttention(hidden_size, num_heads, qkv_bias))
            setattr(self, f"{stream}_norm2", layer_norm(hidden_size))
            setattr(self, f"{stream}_mlp", mlp(hidden_size, mlp_ratio))

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, rotation: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """img (B, N, D), txt (B, T, D), vec (B, D), rotation of [text; image] -> img, txt."""
        # (shift, scale, gate) of the attention, then of the MLP; each (B, 1, D)
        img_mods, txt_mods = self.img_mod(vec), self.txt_mod(vec)
        img_qkv = self.img_attn.heads(shifted_norm(self.img_norm1, img, *img_mods[:2]))
        txt_qkv = self.txt_attn.heads(shifted_norm(self.txt_norm1, txt, *txt_mods[:2]))
        q, k, v = (torch.cat(pair, dim=1) for pair in zip(txt_qkv, img_qkv, strict=True))
        txt_out, img_out = attention(q, k, v, rotation).split([txt.shape[1], img.shape[1]], dim=1)
        img = self._residuals(img, img_out, img_mods, self.img_attn, self.img_norm2, self.img_mlp)
        txt = self._residuals(txt, txt_out, txt_mods, self.txt_attn, self.txt_norm2, self.txt_mlp)
        return img, txt

    @staticmethod
    def _residuals(x, attn_out, mods, attn, norm2, mlp_layers) -> torch.Tensor:
        """The gated attention residual, then the gated MLP of the modulated result."""
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        x = gated(x, gate_msa, attn.proj(attn_out))
        return gated(x, gate_mlp, mlp_layers(shifted_norm(norm2, x, shift_mlp, scale_mlp)))


class SingleStreamBlock(nn.Module):
    """A parallel block on the joint sequence: `linear1` -> [q k v | mlp], attention and GELU side
    by side, `linear2` of their concatenation, one gate (ViT-22B's parallel layers)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.mlp_hidden = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, 3 * hidden_size + self.mlp_hidden)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = layer_norm(hidden_size)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, 3)

    def forward(
        self, x: torch.Tensor, vec: torch.Tensor, rotation: torch.Tensor, start: int = 0
    ) -> torch.Tensor:
        """x (B, T + N, D) -> its rows start .. T + N, (B, T + N - start, D). Every row is a
        key and value of the attention; only the returned rows need a query, an MLP and
        `linear2` (Flux's last block returns the image rows: nothing reads its text rows)."""
        shift, scale, gate = self.modulation(vec)  # each (B, 1, D)
        hidden = self.linear1(shifted_norm(self.pre_norm, x, shift, scale))
        # one split into views: the backward gathers the four gradients with one copy (a split
        # of [q k v] and then an unbind of it would copy the q, k, v gradients twice)
        *qkv, mlp_in = hidden.split([self.hidden_size] * 3 + [self.mlp_hidden], dim=-1)
        q, k, v = (part.unflatten(-1, (self.num_heads, -1)) for part in qkv)  # (B, L, heads, hd)
        q, k = self.norm(q[:, start:], k, v)
        attn = attention(q, k, v, rotation, q_start=start)
        out = torch.cat([attn, self.mlp_act(mlp_in[:, start:])], dim=-1)
        return gated(x[:, start:], gate, self.linear2(out))


# --- the model ----------------------------------------------------------------------------------


class Flux(nn.Module):
    """Flux.1 (BFL's `flux1-*.safetensors` names).

    Args:
        depth, depth_single_blocks: double-stream (19) and single-stream (38) blocks.
        hidden_size, num_heads: width (3072) and heads (24); the head width must equal
            sum(axes_dim).
        in_channels: latent channels (16, the Flux VAE); each token is a 2x2 patch of them.
        context_dim: width of the T5 tokens `cond["crossattn"]` (4096).
        pooled_dim: width of the pooled CLIP-L vector `cond["vector"]` (768).
        guidance_embed: dev's guidance-scale input `cond["guidance"]` (schnell has none).
        guidance: the guidance scale used when `cond` has no "guidance" (None: it must be given).
        sample_size: the latent side for LatentDiffusion's default image (128 = 1024 px).
        use_checkpoint: gradient checkpointing of every block while training.
    """

    # The config key that sets each conditioning field's width (ldm.conditioning's check).
    field_keys = {"crossattn": "context_dim", "vector": "pooled_dim"}

    def __init__(
        self,
        depth: int = 19,
        depth_single_blocks: int = 38,
        hidden_size: int = 3072,
        num_heads: int = 24,
        mlp_ratio: float = 4.0,
        in_channels: int = 16,
        context_dim: int = CONTEXT_DIM,
        pooled_dim: int = POOLED_DIM,
        axes_dim: Sequence[int] = AXES_DIM,
        theta: float = THETA,
        qkv_bias: bool = True,
        guidance_embed: bool = True,
        guidance: float | None = None,
        sample_size: int = 128,
        use_checkpoint: bool = False,
    ):
        super().__init__()
        check_whole_numbers(0, depth=depth, depth_single_blocks=depth_single_blocks)
        check_whole_numbers(
            hidden_size=hidden_size,
            num_heads=num_heads,
            in_channels=in_channels,
            context_dim=context_dim,
            pooled_dim=pooled_dim,
            sample_size=sample_size,
        )
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if sum(axes_dim) != hidden_size // num_heads or any(d % 2 for d in axes_dim):
            raise ValueError(
                f"axes_dim {list(axes_dim)} must be even and sum to the head width "
                f"{hidden_size // num_heads} (hidden_size / num_heads)"
            )
        # Geometry read by LatentDiffusion.
        self.in_channels = self.out_channels = in_channels
        self.patch_size = self.size_multiple = 2
        self.image_size = sample_size
        self.learn_sigma = False
        self.axes_dim, self.theta = tuple(axes_dim), theta
        self.guidance = guidance
        self.use_checkpoint = use_checkpoint

        self.img_in = nn.Linear(in_channels * self.patch_size**2, hidden_size)
        self.time_in = MLPEmbedder(FREQUENCY_EMBEDDING_SIZE, hidden_size)
        self.field_widths = {"crossattn": context_dim, "vector": pooled_dim}
        self.vector_in = MLPEmbedder(pooled_dim, hidden_size)
        self.guidance_in = (
            MLPEmbedder(FREQUENCY_EMBEDDING_SIZE, hidden_size) if guidance_embed else None
        )
        self.txt_in = nn.Linear(context_dim, hidden_size)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(hidden_size, num_heads, mlp_ratio, qkv_bias) for _ in range(depth)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth_single_blocks)
        )
        self.final_layer = FinalLayer(hidden_size, self.patch_size, in_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Xavier-uniform linears, zero biases, and every modulation and the output layer at zero,
        so each block starts as the identity (DiT's adaLN-Zero; BFL released no training code,
        fine-tuning loads the real weights)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        zero = [m.lin for m in self.modules() if isinstance(m, Modulation)]
        for layer in [*zero, self.final_layer.adaLN_modulation[-1], self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in the backward pass (training only)."""
        self.use_checkpoint = enabled

    def lora_targets(self) -> list[str]:
        """The Linear layers LoRA adapts in this backbone (`lora_targets` below; ldm.lora asks
        a backbone that has this method instead of matching UNet layer names)."""
        return lora_targets(self)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/2 * W/2, C * 4), each patch channel-major (c, ph, pw), patches
        in raster order (BFL's "b c (h ph) (w pw) -> b (h w) (c ph pw)")."""
        b, c, h, w = x.shape
        x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, N, C * 4) -> (B, C, H, W), the inverse of `patchify`."""
        b, c = x.shape[0], self.out_channels
        x = x.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    @staticmethod
    def position_ids(batch: int, text_len: int, h: int, w: int, device=None) -> torch.Tensor:
        """(B, T + N, 3) ids of [text; image]: (0, 0, 0) for text, (0, row, col) for patches."""
        rows, cols = torch.meshgrid(
            torch.arange(h // 2, device=device), torch.arange(w // 2, device=device), indexing="ij"
        )
        img = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
        txt = torch.zeros(text_len, 3, dtype=img.dtype, device=device)
        return torch.cat([txt, img]).float()[None].expand(batch, -1, -1)

    def _run(self, block: nn.Module, *args):
        if self.use_checkpoint and self.training and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """x (B, 16, H, W) latent, t (B,) on the 0..1000 scale (sigma * 1000), cond["crossattn"]
        (B, T, 4096) T5 tokens, cond["vector"] (B, 768) pooled CLIP-L, cond["guidance"] (B,)
        guidance scale (dev) -> (B, 16, H, W), the velocity e - x_0 of rectified flow."""
        missing = [key for key in ("crossattn", "vector") if key not in cond]
        if missing:
            raise ValueError(
                f"Flux needs cond {missing}: the T5 tokens ('crossattn') and the pooled CLIP-L "
                "vector ('vector')"
            )
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"latent sides {h}x{w} must be multiples of the patch size 2")
        img = self.img_in(self.patchify(x))  # (B, N, D)
        dtype = img.dtype
        vec = self.time_in(timestep_embedding(t, FREQUENCY_EMBEDDING_SIZE).to(dtype))  # (B, D)
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(self._guidance_embedding(cond, b, x.device).to(dtype))
        vec = vec + self.vector_in(cond["vector"].to(dtype))
        txt = self.txt_in(cond["crossattn"].to(dtype))  # (B, T, D)
        rotation = rope(
            self.position_ids(b, txt.shape[1], h, w, x.device), self.axes_dim, self.theta
        )  # (B, T + N, 1, head_dim / 2), complex
        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, rotation)
        joint = torch.cat([txt, img], dim=1)  # (B, T + N, D)
        for index, block in enumerate(self.single_blocks):
            # the final layer reads the image rows only: the last block returns just those
            start = txt.shape[1] if index == len(self.single_blocks) - 1 else 0
            joint = self._run(block, joint, vec, rotation, start)
        img = self.final_layer(joint[:, joint.shape[1] - img.shape[1] :], vec)  # (B, N, 64)
        return self.unpatchify(img, h, w)  # (B, 16, H, W)

    def _guidance_embedding(self, cond: Mapping, batch: int, device) -> torch.Tensor:
        """(B, 256) sinusoids of guidance * 1000 (BFL's timestep_embedding time_factor)."""
        guidance = cond.get("guidance")
        if guidance is None:
            if self.guidance is None:
                raise ValueError(
                    "Flux dev needs cond['guidance'] (the guidance scale, e.g. 3.5) or the "
                    "backbone's `guidance` parameter"
                )
            guidance = torch.full((batch,), float(self.guidance), device=device)
        guidance = torch.as_tensor(guidance, device=device).float().expand(batch)
        return timestep_embedding(guidance * GUIDANCE_SCALE_FACTOR, FREQUENCY_EMBEDDING_SIZE)

    def blocks_in_order(self) -> list[nn.Module]:
        """The blocks base quantization and block swap act on (ldm.block_swap.blocks_of), in
        the order they run: the double-stream blocks, then the single-stream ones. Left as they
        are: `img_in`, `txt_in`, the time / guidance / vector MLPs, and the final layer."""
        return [*self.double_blocks, *self.single_blocks]


# --- presets (BFL src/flux/util.py configs "flux-dev", "flux-schnell") -------------------------


def flux1_dev(**kwargs) -> Flux:
    """FLUX.1 [dev]: 19 double + 38 single blocks, width 3072, 24 heads, guidance input."""
    return Flux(**{"guidance_embed": True, **kwargs})


def flux1_schnell(**kwargs) -> Flux:
    """FLUX.1 [schnell]: as dev without the guidance embedding (timestep-distilled, 1-4 steps)."""
    return Flux(**{"guidance_embed": False, **kwargs})


def lora_targets(model: Flux, modulation: bool = True) -> list[str]:
    """Names (in `model`) of the Linear layers LoRA adapts: every Linear of the double and single
    blocks, kohya's default Flux network (sd-scripts networks/lora_flux.py); `modulation=False`
    leaves out the adaLN `*_mod.lin` / `modulation.lin` layers."""
    groups = {"double_blocks": model.double_blocks, "single_blocks": model.single_blocks}
    return [
        f"{group}.{name}"
        for group, blocks in groups.items()
        for name, module in blocks.named_modules()
        if isinstance(module, nn.Linear)
        and (modulation or not name.endswith("mod.lin") and not name.endswith("modulation.lin"))
    ]
