"""Cross-attention: the decoder's queries attend to a memory (the encoder's tokens) on the one core."""

from __future__ import annotations

import math

from torch import Tensor, nn

from vitkit.errors import UsageError

from .attention import Attention
from .kv_cache import MemoryKV


class CrossAttention(Attention):
    """Attention from x to a memory (the decoder's cross-attention, Vaswani et al., 2017): q from x, k and v
    from the memory, projected once per decode and kept in a :class:`MemoryKV`."""

    def __init__(self, dim: int, num_heads: int, *, kv_dim: int | None = None, **kw) -> None:
        self._kv_dim = kv_dim or dim  # a plain int (allowed before nn.Module.__init__), read by in_projections
        super().__init__(dim, num_heads, **kw)

    def in_projections(self, dim: int, qkv_bias: bool) -> None:
        self.q = nn.Linear(dim, self.num_heads * self.head_dim, bias=qkv_bias)
        self.kv = nn.Linear(self._kv_dim, 2 * self.num_kv_heads * self.head_dim, bias=qkv_bias)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention K/V of a memory (B, M, C) -> (B, Hkv, M, D) each."""
        kv = self.kv(memory).unflatten(-1, (2, self.num_kv_heads, self.head_dim))  # (B, M, 2, Hkv, D)
        kv = kv.permute(2, 0, 3, 1, 4)  # (2, B, Hkv, M, D)
        return kv[0], kv[1]

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        bias: Tensor | None = None,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        cache: MemoryKV | None = None,
        return_attn: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, [G,] N, C) to ``memory`` (B, M, C_kv), or to the K/V ``cache`` holds.
        Masks as in :meth:`Attention.forward`, with M memory tokens."""
        N, C = x.shape[-2], x.shape[-1]
        lead = x.shape[:-2]
        B, G = lead[0], math.prod(lead[1:])
        q = self.q(x.reshape(-1, N, C)).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B·G, H, N, D)
        if cache is not None and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            if memory is None:
                raise UsageError("cross-attention needs a memory tensor (B, M, C)")
            k, v = self.project_kv(memory)  # (B, Hkv, M, D)
            if cache is not None:
                cache.k, cache.v = k, v
        if G > 1:  # the same memory for every group
            k, v = (t.unsqueeze(1).expand(B, G, *t.shape[1:]).reshape(B * G, *t.shape[1:]) for t in (k, v))
        o, attn = self.attend(q, k, v, lead, bias, attn_mask, key_padding_mask, False, return_attn)
        return (o, attn) if return_attn else o
