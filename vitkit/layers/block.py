"""Transformer blocks, composed of the parts they are given: an attention, an MLP and a norm.

:class:`Block` is the pre-norm block of ViT, Swin and the pre-LN Transformer; :class:`PostNormBlock` the
original Transformer's; :class:`DecoderBlock` adds a cross-attention branch between the two; :class:`WindowBlock`
is Swin's, the pre-norm block on windows with its relative-position bias. Parameter names
(``norm1``, ``attn``, ``ls1``, ``norm2``, ``mlp``, ``ls2``) are timm's. Each block writes its residuals out in
its ``forward`` (a few lines each), so the ViT and Swin blocks stay scriptable by TorchScript.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .attention import Attention
from .cross_attention import CrossAttention
from .drop import DropPath
from .kv_cache import MemoryKV
from .layer_scale import LayerScale
from .token_merging import bipartite_merge, proportional_bias

torch.fx.wrap("bipartite_merge")  # its merge count follows the input's token count: one node of a traced graph

NormLayer = Callable[[int], nn.Module]


def _scale(dim: int, init_values: float | None) -> nn.Module:
    return LayerScale(dim, init_values) if init_values else nn.Identity()


class Block(nn.Module):
    """Pre-norm transformer block (Xiong et al., 2020): x + attn(norm1(x)), then x + mlp(norm2(x)), each
    branch through LayerScale (when ``init_values``) and DropPath. The arguments of :meth:`forward` after x go
    to the attention (see :meth:`Attention.forward`)."""

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

    def forward(self, x: Tensor, bias: Tensor | None = None, attn_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                rope: tuple[Tensor, Tensor] | None = None, cache: Any = None) -> Tensor:
        """x (B, [G,] N, C) -> the same shape."""
        a = self.attn(self.norm1(x), bias, attn_mask, key_padding_mask, is_causal, rope, cache)
        x = x + self.drop_path1(self.ls1(a))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def forward_merging(self, x: Tensor, size: Tensor | None, r: int, num_prefix: int,
                        where: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """:meth:`forward` with token merging (ToMe) between attention and the MLP: attention adds log(size) of each
        key to the scores, then r token pairs merge by their keys' similarity (``layers/token_merging.py``).
        x (B, N, C) -> (B, N - r, C), with the tokens' sizes and ``where`` (see ``bipartite_merge``)."""
        q, k, v = self.attn.project(self.norm1(x))
        a = self.attn.attend(q, k, v, [x.shape[0]], proportional_bias(size))[0]
        x = x + self.drop_path1(self.ls1(a))
        if r > 0:
            x, size, where = bipartite_merge(x, k.mean(dim=1), size, r, num_prefix, where)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))), size, where


class ResPostNormBlock(Block):
    """Residual post-norm block (Swin V2, Liu et al., 2022; EVA-02-E): x + norm1(attn(x)), then x + norm2(mlp(x)):
    each branch is normed before it joins the residual stream, which stays un-normed."""

    def forward(self, x: Tensor, bias: Tensor | None = None, attn_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                rope: tuple[Tensor, Tensor] | None = None, cache: Any = None) -> Tensor:
        a = self.attn(x, bias, attn_mask, key_padding_mask, is_causal, rope, cache)
        x = x + self.drop_path1(self.ls1(self.norm1(a)))
        return x + self.drop_path2(self.ls2(self.norm2(self.mlp(x))))

    def forward_merging(self, x: Tensor, size: Tensor | None, r: int, num_prefix: int,
                        where: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        q, k, v = self.attn.project(x)
        a = self.attn.attend(q, k, v, [x.shape[0]], proportional_bias(size))[0]
        x = x + self.drop_path1(self.ls1(self.norm1(a)))
        if r > 0:
            x, size, where = bipartite_merge(x, k.mean(dim=1), size, r, num_prefix, where)
        return x + self.drop_path2(self.ls2(self.norm2(self.mlp(x)))), size, where


class PostNormBlock(Block):
    """Post-norm block of the original Transformer (Vaswani et al., 2017): norm1(x + attn(x)), then
    norm2(x + mlp(x))."""

    def forward(self, x: Tensor, bias: Tensor | None = None, attn_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                rope: tuple[Tensor, Tensor] | None = None, cache: Any = None) -> Tensor:
        a = self.attn(x, bias, attn_mask, key_padding_mask, is_causal, rope, cache)
        x = self.norm1(x + self.drop_path1(self.ls1(a)))
        return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))


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
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), **attn_args)))
        a = self.cross_attn(self.norm_cross(x), memory, key_padding_mask=memory_padding_mask, cache=memory_cache)
        x = x + self.drop_path_cross(self.ls_cross(a))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PostNormDecoderBlock(DecoderBlock):
    """The decoder block with post-norm residuals, as in the paper."""

    def forward(self, x: Tensor, memory: Tensor | None = None, *, memory_padding_mask: Tensor | None = None,
                memory_cache: MemoryKV | None = None, **attn_args) -> Tensor:
        x = self.norm1(x + self.drop_path1(self.ls1(self.attn(x, **attn_args))))
        a = self.cross_attn(x, memory, key_padding_mask=memory_padding_mask, cache=memory_cache)
        x = self.norm_cross(x + self.drop_path_cross(self.ls_cross(a)))
        return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))


class WindowBlock(Block):
    """Swin's block: the pre-norm :class:`Block` on windows, whose attention adds the relative-position bias of
    the window it is given. The bias is read inside the block's forward, where a sharded (FSDP) block has its
    parameters gathered."""

    def forward(self, x: Tensor, window: tuple[int, int] | None = None, attn_mask: Tensor | None = None,
                keep: Tensor | None = None) -> Tensor:
        """x (B, nW, N, C), the windows of a map; ``window`` their size (None: the planned one); attn_mask
        (1, nW, 1, N, N) from the window plan; ``keep`` (1, nW, N, 1) zeroes the padding after the norm, where
        the padding is attended as zero vectors."""
        if torch.jit.is_scripting() or window is None:  # TorchScript runs the configured size: the planned window
            bias = self.attn.planned_bias()
        else:
            bias = self.attn.relative_position_bias(window)[None, None]
        h = self.norm1(x)
        if keep is not None:
            h = h * keep.to(h.dtype)
        x = x + self.drop_path1(self.ls1(self.attn(h, bias, attn_mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
