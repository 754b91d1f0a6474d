"""Transformer blocks, composed of the parts they are given: an attention, an MLP and a norm.

:class:`Block` is the pre-norm block of ViT, Swin and the pre-LN Transformer; :class:`PostNormBlock` the
original Transformer's; :class:`DecoderBlock` adds a cross-attention branch between the two. Parameter names
(``norm1``, ``attn``, ``ls1``, ``norm2``, ``mlp``, ``ls2``) are timm's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor, nn

from .attention import Attention
from .cross_attention import CrossAttention
from .drop import DropPath
from .kv_cache import MemoryKV
from .layer_scale import LayerScale

NormLayer = Callable[[int], nn.Module]


def _scale(dim: int, init_values: float | None) -> nn.Module:
    return LayerScale(dim, init_values) if init_values else nn.Identity()


class Block(nn.Module):
    """Pre-norm transformer block (Xiong et al., 2020): x + attn(norm1(x)), then x + mlp(norm2(x)), each
    branch through LayerScale (when ``init_values``) and DropPath. Keywords of :meth:`forward` go to the
    attention."""

    def __init__(self, dim: int, attn: Attention, mlp: nn.Module, *, norm_layer: NormLayer = nn.LayerNorm,
                 init_values: float | None = None, drop_path: float = 0.0) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.ls1 = _scale(dim, init_values)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = norm_layer(dim)
        self.mlp = mlp
        self.ls2 = _scale(dim, init_values)
        self.drop_path2 = DropPath(drop_path)

    def residual(self, x: Tensor, norm: nn.Module, branch: Callable[[Tensor], Tensor], ls: nn.Module,
                 drop_path: nn.Module) -> Tensor:
        return x + drop_path(ls(branch(norm(x))))

    def forward(self, x: Tensor, **attn_args) -> Tensor:
        """x (B, [G,] N, C) -> the same shape."""
        x = self.residual(x, self.norm1, partial(self.attn, **attn_args), self.ls1, self.drop_path1)
        return self.residual(x, self.norm2, self.mlp, self.ls2, self.drop_path2)


class PostNormBlock(Block):
    """Post-norm block of the original Transformer (Vaswani et al., 2017): norm1(x + attn(x)), then
    norm2(x + mlp(x))."""

    def residual(self, x: Tensor, norm: nn.Module, branch: Callable[[Tensor], Tensor], ls: nn.Module,
                 drop_path: nn.Module) -> Tensor:
        return norm(x + drop_path(ls(branch(x))))


class DecoderBlock(Block):
    """The Transformer's decoder block (Vaswani et al., 2017): self-attention (causal when the caller says so),
    cross-attention to a memory, then the MLP; pre-norm."""

    def __init__(self, dim: int, attn: Attention, cross_attn: CrossAttention, mlp: nn.Module, *,
                 norm_layer: NormLayer = nn.LayerNorm, init_values: float | None = None,
                 drop_path: float = 0.0) -> None:
        super().__init__(dim, attn, mlp, norm_layer=norm_layer, init_values=init_values, drop_path=drop_path)
        self.norm_cross = norm_layer(dim)
        self.cross_attn = cross_attn
        self.ls_cross = _scale(dim, init_values)
        self.drop_path_cross = DropPath(drop_path)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, memory_padding_mask: Tensor | None = None,
                memory_cache: MemoryKV | None = None, **attn_args) -> Tensor:
        """x (B, T, C); ``memory`` (B, M, C_mem) with its padding mask, or its K/V in ``memory_cache``."""
        x = self.residual(x, self.norm1, partial(self.attn, **attn_args), self.ls1, self.drop_path1)
        x = self.residual(x, self.norm_cross, partial(self.cross_attn, memory=memory, cache=memory_cache,
                                                      key_padding_mask=memory_padding_mask),
                          self.ls_cross, self.drop_path_cross)
        return self.residual(x, self.norm2, self.mlp, self.ls2, self.drop_path2)


class PostNormDecoderBlock(PostNormBlock, DecoderBlock):
    """The decoder block with post-norm residuals, as in the paper."""
