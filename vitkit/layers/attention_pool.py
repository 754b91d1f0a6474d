"""Multi-head attention pooling (MAP): one learned query attends to every token, on the one attention core."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .cross_attention import CrossAttention
from .mlp import Mlp


class AttentionPool(CrossAttention):
    """The MAP head of big_vision's ViT and SigLIP (Zhai et al., 2022; Zhai et al., 2023): a learned latent
    query cross-attends to the tokens, then a pre-norm MLP with a residual; the pooled vector is the latent's
    output. Parameter names are timm's ``AttentionPoolLatent`` (``latent``, ``q``, ``kv``, ``proj``, ``norm``,
    ``mlp``), so its checkpoints load as they are."""

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: float = 4.0, act: Callable[[], nn.Module] = nn.GELU,
                 norm_eps: float = 1e-6, **kw) -> None:
        super().__init__(dim, num_heads, **kw)
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Tokens (B, N, C) -> one pooled vector per image (B, C); ``key_padding_mask`` (B, N), True where a
        slot holds no token of the image."""
        B = x.shape[0]
        q = self.q(self.latent).expand(B, -1, -1)  # (B, 1, C): the one query, projected once
        q = q.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, H, 1, D)
        k, v = self.project_kv(x)  # (B, Hkv, N, D) each
        o = self.attend(q, k, v, [B], key_padding_mask=key_padding_mask)[0]  # (B, 1, C)
        return (o + self.mlp(self.norm(o)))[:, 0]
