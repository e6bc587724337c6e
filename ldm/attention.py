"""Cross-attention transformer of the Stable Diffusion UNet (CompVis parameter names).

SpatialTransformer -> BasicTransformerBlock -> CrossAttention / FeedForward, as in the original
`ldm.modules.attention`, so checkpoint keys such as
`input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight` line up exactly. Attention itself runs
on `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels where the
device has them); xformers is an optional backend.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_BACKENDS = ("sdpa", "xformers")
# PyTorch's fused attention kernels by name (`torch.nn.attention.SDPBackend`). Which run where
# depends on the device and the build (a CPU build has math and flash, not efficient or cuDNN).
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")


def sdpa_kernels(names) -> list:
    """`attention_kernels` (a name or a list of names from SDPA_KERNELS) -> the SDPBackend list
    for `torch.nn.attention.sdpa_kernel`. On a machine without CUDA each kernel is tried on a
    tiny CPU input here, so one it cannot run fails at model construction, not at step one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"attention_kernels: empty; give one or more of {SDPA_KERNELS} or null")
    cuda = torch.cuda.is_available()
    for name in names:
        if name not in backends:
            raise ValueError(f"attention_kernels: {name!r} is not one of {SDPA_KERNELS}")
        if cuda:
            continue  # not tried here: that would start CUDA before Lightning places the model
        probe = torch.zeros(1, 1, 2, 8)
        try:
            with warnings.catch_warnings(), sdpa_kernel([backends[name]]):
                warnings.simplefilter("ignore")  # PyTorch's own reasons, one per kernel
                F.scaled_dot_product_attention(probe, probe, probe)
        except RuntimeError:
            raise ValueError(
                f"attention_kernels: {name!r} cannot run on this machine (no CUDA device); "
                "use math or flash, or null (PyTorch picks)"
            ) from None
    return [backends[name] for name in names]


def preferring(backends: list):
    """`torch.nn.attention.sdpa_kernel` over `backends` (from `sdpa_kernels`) in their order of
    preference, then math. `set_priority`: without it the list only enables kernels and PyTorch
    picks in its own order (flash, efficient, math, cuDNN: `torch._C._get_sdp_priority_order()`),
    so `[cudnn, flash]` would run flash wherever flash can. Math last, chosen only where none of
    `backends` takes the call: flash and cuDNN take fp16 / bf16 only, and the float32 attention
    of sampling outside autocast (the image logger, txt2img's default `--precision full`) or of
    SD 2's `upcast_attention` would otherwise fail on CUDA with "No available kernel"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    last = [] if SDPBackend.MATH in backends else [SDPBackend.MATH]
    return sdpa_kernel([*backends, *last], set_priority=True)


def _xformers_ops():
    """Import `xformers.ops` on first use; it is optional and absent on CPU-only installs."""
    try:
        import xformers.ops
    except ImportError as err:
        raise ImportError(
            "attention_backend='xformers' needs the xformers package: `pip install xformers` "
            "(or use attention_backend='sdpa', PyTorch's built-in fused attention)"
        ) from err
    return xformers.ops


def check_attention_backend(backend: str) -> None:
    """Fail at model construction, not at the first training step, for a bad or missing backend."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "xformers":
        _xformers_ops()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    backend: str = "sdpa",
    upcast: bool = False,
) -> torch.Tensor:
    """Multi-head softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017, eq. 1).

    q (B, N, heads * d), k and v (B, M, heads * d) -> (B, N, heads * d).
    `upcast` computes the attention in float32 with autocast off, as Stable Diffusion 2's
    `_ATTN_PRECISION = "fp32"` does, because fp16 logits overflow in the 768px v-model.
    """
    dtype = q.dtype
    if upcast and dtype != torch.float32:
        with torch.autocast(device_type=q.device.type, enabled=False):
            out = attention(q.float(), k.float(), v.float(), heads, backend)
        return out.to(dtype)
    batch, n_queries, inner = q.shape
    dim_head = inner // heads
    if backend == "xformers":
        # xformers takes (B, N, heads, d) directly: both views are free.
        split = (batch, -1, heads, dim_head)
        out = _xformers_ops().memory_efficient_attention(
            q.view(split), k.view(split), v.view(split)
        )
        return out.reshape(batch, n_queries, inner)
    # SDPA wants (B, heads, N, d); the transposes are views, the kernels accept the strides.
    q, k, v = (t.unflatten(-1, (heads, dim_head)).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, d)
    return out.transpose(1, 2).reshape(batch, n_queries, inner)


class CrossAttention(nn.Module):
    """Multi-head attention of `x` over `context` (self-attention when context is None).

    Args:
        query_dim: channels of x.
        context_dim: channels of the context (text embedding width); None = query_dim.
        heads: number of heads.
        dim_head: channels per head.
        dropout: dropout after the output projection.
        backend: "sdpa" (PyTorch) or "xformers".
        upcast: compute attention in float32 (fp16 stability).
    """

    def __init__(
        self,
        query_dim: int,
        context_dim: int | None = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        backend: str = "sdpa",
        upcast: bool = False,
    ):
        super().__init__()
        check_attention_backend(backend)
        inner_dim = heads * dim_head
        context_dim = query_dim if context_dim is None else context_dim
        self.heads = heads
        self.backend = backend
        self.upcast = upcast
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context  # (B, M, context_dim)
        q = self.to_q(x)  # (B, N, inner)
        k = self.to_k(context)  # (B, M, inner)
        v = self.to_v(context)  # (B, M, inner)
        out = attention(q, k, v, self.heads, self.backend, self.upcast)  # (B, N, inner)
        return self.to_out(out)  # (B, N, query_dim)


class GEGLU(nn.Module):
    """Gated GELU projection (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = self.proj(x).chunk(2, dim=-1)  # (B, N, dim_out) each
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU MLP with hidden width mult * dim (`net.0.proj` [2*mult*dim, dim], `net.2`)."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0):
        super().__init__()
        inner_dim = dim * mult
        self.net = nn.Sequential(
            GEGLU(dim, inner_dim), nn.Dropout(dropout), nn.Linear(inner_dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, N, dim)


class BasicTransformerBlock(nn.Module):
    """Pre-norm transformer block: self-attention, cross-attention over the context, GEGLU MLP."""

    def __init__(
        self,
        dim: int,
        heads: int,
        dim_head: int,
        context_dim: int | None = None,
        dropout: float = 0.0,
        backend: str = "sdpa",
        upcast: bool = False,
    ):
        super().__init__()
        self.attn1 = CrossAttention(dim, None, heads, dim_head, dropout, backend, upcast)
        self.ff = FeedForward(dim, dropout=dropout)
        self.attn2 = CrossAttention(dim, context_dim, heads, dim_head, dropout, backend, upcast)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        # Residual adds go in place into the fresh sublayer outputs: a linear layer does not need
        # its output for backward, and each saved allocation is a page-faulting malloc on CPU.
        x = self.attn1(self.norm1(x)).add_(x)  # (B, N, dim)
        x = self.attn2(self.norm2(x), context).add_(x)  # (B, N, dim)
        return self.ff(self.norm3(x)).add_(x)  # (B, N, dim)


def over_channels(layer: nn.Module, h: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, HW, C) -> (B, HW, C') by proj_in / proj_out. A 1x1 conv is a linear map over channels:
    applied as one on this layout, SD 1 and SD 2 share a path without a conv + permute copy. A
    layer that must run its own forward - wrapped by a LoRA adapter (`ldm.lora`), or frozen in
    another dtype outside autocast - is called as itself, in its own layout."""
    if type(layer) in (nn.Linear, nn.Conv2d) and (  # not a quantized subclass (ldm.quantize)
        layer.weight.dtype == h.dtype or torch.is_autocast_enabled(h.device.type)
    ):
        return F.linear(h, layer.weight.flatten(1), layer.bias)
    if layer.weight.dim() == 2:  # a Linear
        return layer(h)
    x = h.transpose(1, 2).reshape(h.shape[0], -1, height, width)  # (B, C, H, W)
    return layer(x).flatten(2).transpose(1, 2)  # (B, HW, C')


class SpatialTransformer(nn.Module):
    """Transformer over the H*W positions of a feature map, conditioned on a context sequence.

    Args:
        in_channels: channels C of the feature map.
        heads, dim_head: attention heads and channels per head; the transformer is
            heads * dim_head wide (proj_in maps C to that width, proj_out back).
        depth: number of BasicTransformerBlocks.
        context_dim: width of the cross-attention context (None = attend to x itself).
        dropout: dropout in attention outputs and feed-forward.
        use_linear: proj_in / proj_out are Linear layers (SD 2) instead of 1x1 convs (SD 1).
        backend, upcast: see CrossAttention.
    """

    def __init__(
        self,
        in_channels: int,
        heads: int,
        dim_head: int,
        depth: int = 1,
        context_dim: int | None = None,
        dropout: float = 0.0,
        use_linear: bool = False,
        backend: str = "sdpa",
        upcast: bool = False,
    ):
        super().__init__()
        inner_dim = heads * dim_head
        self.use_linear = use_linear
        self.norm = nn.GroupNorm(32, in_channels, eps=1e-6)
        if use_linear:
            self.proj_in = nn.Linear(in_channels, inner_dim)
            self.proj_out = nn.Linear(inner_dim, in_channels)
        else:
            self.proj_in = nn.Conv2d(in_channels, inner_dim, 1)
            self.proj_out = nn.Conv2d(inner_dim, in_channels, 1)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(inner_dim, heads, dim_head, context_dim, dropout, backend, upcast)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        batch, _, height, width = x.shape
        h = self.norm(x)  # (B, C, H, W)
        h = h.permute(0, 2, 3, 1).reshape(batch, height * width, -1)  # (B, HW, C)
        h = over_channels(self.proj_in, h, height, width)  # (B, HW, inner)
        for block in self.transformer_blocks:
            h = block(h, context)  # (B, HW, inner)
        h = over_channels(self.proj_out, h, height, width)  # (B, HW, C)
        h = h.view(batch, height, width, -1).permute(0, 3, 1, 2)  # (B, C, H, W) channels-last view
        # x first: the sum takes x's NCHW layout. A channels-last result would flow into the next
        # convs, which then copy their NCHW weights on every call.
        return x + h
