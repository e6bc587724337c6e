"""Text-conditional DiT in the style of PixArt-alpha (Chen et al. 2023, arXiv:2310.00426, sec. 2.3).

Three changes to DiT's block: (1) cross-attention to the text encoder's tokens after the
self-attention; (2) "adaLN-single": the timestep alone drives one modulation MLP (`t_block`)
shared by all blocks, and each block adds its own learned (6, D) table `scale_shift_table` to it -
far fewer parameters than DiT's per-block adaLN MLPs; (3) no class embedding: the caption is the
condition. The patch embedding, positions, timestep MLP and unpatchify are DiT's (`ldm.dit`).
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ldm.dit import Attention, Mlp, PatchTransformer, layer_norm, modulate


class CrossAttention(nn.Module):
    """Queries from the image tokens, keys and values from the text tokens, on SDPA."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_linear = nn.Linear(hidden_size, hidden_size)
        self.kv_linear = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        heads, head_dim = self.num_heads, d // self.num_heads
        q = self.q_linear(x).view(b, n, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        kv = self.kv_linear(context).view(b, context.shape[1], 2, heads, head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4)  # each (B, h, T, d)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))  # (B, N, D)


class TextDiTBlock(nn.Module):
    """Self-attention (modulated, gated), cross-attention to the text, MLP (modulated, gated)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = layer_norm(hidden_size)
        self.attn = Attention(hidden_size, num_heads)
        self.cross_attn = CrossAttention(hidden_size, num_heads)
        self.norm2 = layer_norm(hidden_size)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        # PixArt's per-block offset to the shared modulation, initialised at N(0, 1/D).
        self.scale_shift_table = nn.Parameter(torch.randn(6, hidden_size) / hidden_size**0.5)

    def forward(self, x: torch.Tensor, context: torch.Tensor, t6: torch.Tensor) -> torch.Tensor:
        """x (B, N, D), context (B, T, D), t6 (B, 6, D) the shared modulation."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + t6
        ).unbind(1)  # each (B, D)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + self.cross_attn(x, context)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class TextFinalLayer(nn.Module):
    """Final adaLN-single layer: shift and scale from the timestep embedding plus a learned table."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = layer_norm(hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.scale_shift_table = nn.Parameter(torch.randn(2, hidden_size) / hidden_size**0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.scale_shift_table[None] + t[:, None]).unbind(1)  # each (B, D)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, p*p*C_out)


class TextDiT(PatchTransformer):
    """DiT conditioned on text through cross-attention, with adaLN-single (PixArt-alpha).

    Args:
        context_dim: width of the text encoder's tokens (`crossattn`, e.g. 768 for CLIP ViT-L,
            4096 for T5-XXL); a 2-layer MLP (`y_embedder`) projects them to hidden_size.
        The others as `ldm.dit.DiT` (learn_sigma defaults to False here: eps only).
    """

    # The config key that sets each conditioning field's width (ldm.conditioning's check).
    field_keys = {"crossattn": "context_dim"}

    def __init__(
        self,
        context_dim: int,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        learn_sigma: bool = False,
        use_checkpoint: bool = False,
    ):
        super().__init__(
            input_size, patch_size, in_channels, hidden_size, learn_sigma, use_checkpoint
        )
        self.field_widths = {"crossattn": context_dim}  # the text tokens it projects
        self.y_embedder = Mlp(context_dim, hidden_size, hidden_size)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.blocks = nn.ModuleList(
            TextDiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)
        )
        self.final_layer = TextFinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        super().initialize_weights()
        nn.init.normal_(self.t_block[1].weight, std=0.02)
        nn.init.normal_(self.y_embedder.fc1.weight, std=0.02)
        nn.init.normal_(self.y_embedder.fc2.weight, std=0.02)

    def zero_init_layers(self) -> list[nn.Linear]:
        # PixArt starts each cross-attention at zero so the pretrained-DiT-like path is intact.
        return [block.cross_attn.proj for block in self.blocks] + [self.final_layer.linear]

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """x (B, C, H, W), t (B,), cond["crossattn"] (B, T, context_dim) -> (B, C_out, H, W)."""
        if "crossattn" not in cond:
            raise ValueError("TextDiT needs cond['crossattn'] (a text encoder's tokens)")
        h, w = x.shape[-2:]
        tokens = self.patchify(x)  # (B, N, D)
        t_emb = self.t_embedder(t)  # (B, D)
        t6 = self.t_block(t_emb).unflatten(1, (6, -1))  # (B, 6, D), shared by every block
        context = self.y_embedder(cond["crossattn"].to(t_emb.dtype))  # (B, T, D)
        for block in self.blocks:
            tokens = self.run_block(block, tokens, context, t6)
        tokens = self.final_layer(tokens, t_emb)  # (B, N, p*p*C_out)
        return self.unpatchify(tokens, h, w)


def TextDiT_S_2(**kwargs) -> TextDiT:
    return TextDiT(depth=12, hidden_size=384, patch_size=2, num_heads=6, **kwargs)


def TextDiT_B_2(**kwargs) -> TextDiT:
    return TextDiT(depth=12, hidden_size=768, patch_size=2, num_heads=12, **kwargs)


def TextDiT_XL_2(**kwargs) -> TextDiT:
    """PixArt-alpha's size: 28 blocks of width 1152."""
    return TextDiT(depth=28, hidden_size=1152, patch_size=2, num_heads=16, **kwargs)
