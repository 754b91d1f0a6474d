"""The transformer block: attention and MLP residual branches, optionally a cross-attention branch."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from .attention import Attention, AttnBackend
from .drop import DropPath
from .kv_cache import KVCache
from .layer_scale import LayerScale
from .mlp import Mlp


class Block(nn.Module):
    """Pre-LN transformer block (Xiong et al., 2020), or post-LN as in Vaswani et al. (2017).

    With ``cross=True`` it is the decoder block of the original Transformer: self-attention (causal when the
    caller passes ``is_causal``, as the decoder does), then cross-attention to a memory, then the MLP; all three
    on the one attention core."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = None,
        norm_eps: float = 1e-6,
        norm: Literal["pre", "post"] = "pre",
        num_kv_heads: int | None = None,
        cross: bool = False,
        memory_dim: int | None = None,
        rel_pos_window: tuple[int, int] | None = None,
        attn_backend: AttnBackend = "sdpa",
    ) -> None:
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        self.post_norm = norm == "post"
        attn_kw = dict(num_kv_heads=num_kv_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop,
                       backend=attn_backend)
        ls = (lambda: LayerScale(dim, init_values)) if init_values else nn.Identity
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, rel_pos_window=rel_pos_window, **attn_kw)
        self.ls1 = ls()
        self.drop_path1 = DropPath(drop_path)
        if cross:
            self.norm_cross = nn.LayerNorm(dim, eps=norm_eps)
            self.cross_attn = Attention(dim, num_heads, cross=True, kv_dim=memory_dim, **attn_kw)
            self.ls_cross = ls()
            self.drop_path_cross = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = ls()
        self.drop_path2 = DropPath(drop_path)

    def _residual(self, x: Tensor, norm: nn.Module, branch, ls: nn.Module, drop_path: nn.Module) -> Tensor:
        if self.post_norm:
            return norm(x + drop_path(ls(branch(x))))
        return x + drop_path(ls(branch(norm(x))))

    def forward(
        self,
        x: Tensor,
        *,
        bias: Tensor | None = None,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        memory_cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, [G,] N, C). Self-attention arguments as in :class:`Attention`; ``memory`` (B, M, C_mem)
        and its padding mask / cache feed the cross-attention branch of a decoder block."""
        x = self._residual(x, self.norm1, lambda h: self.attn(
            h, bias=bias, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            rope=rope, cache=cache), self.ls1, self.drop_path1)
        if hasattr(self, "cross_attn"):
            x = self._residual(x, self.norm_cross, lambda h: self.cross_attn(
                h, memory, key_padding_mask=memory_padding_mask, cache=memory_cache),
                self.ls_cross, self.drop_path_cross)
        return self._residual(x, self.norm2, self.mlp, self.ls2, self.drop_path2)
