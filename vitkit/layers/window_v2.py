"""Swin Transformer V2's window attention (Liu et al., 2022) on the one core: scaled cosine attention and the
continuous, log-spaced relative-position bias, and its residual post-norm block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import attention
from .block import WindowBlock
from .window import CPU, WindowAttention, eager_cache

torch.fx.wrap("attention")  # one node of a traced graph, as in attention.py (fx patches each module's own name)


@eager_cache
def log_spaced_offsets(window: tuple[int, int], pretrained_window: tuple[int, int]) -> Tensor:
    """((2·wh - 1)·(2·ww - 1), 2): every 2-D offset within a window, scaled so the pretraining window's edge is
    at ±8, then log-spaced, sign(d)·log2(1 + |d|) / 3, into about [-1, 1]: the points where the bias MLP is read.
    A window larger than the pretraining one reads the MLP a little beyond the range it was trained on."""
    axes = []
    for size, ref in zip(window, pretrained_window, strict=True):
        d = torch.arange(-(size - 1), size, dtype=torch.float32, device=CPU)
        axes.append(d / max(ref - 1, 1) * 8)
    dh, dw = torch.meshgrid(axes[0], axes[1], indexing="ij")
    d = torch.stack([dh, dw], dim=-1).reshape(-1, 2)
    return torch.sign(d) * torch.log2(d.abs() + 1.0) / math.log2(8)


class CosineWindowAttention(WindowAttention):
    """Window attention of Swin V2: cosine similarity of q and k times a learned per-head temperature (at most 100),
    plus 16·sigmoid of a bias that a small MLP reads at each log-spaced offset. On the one core: q and k are
    L2-normalised and the temperature is folded into q (the core's scale is 1), and the bias is an additive bias,
    so the fused kernels run it. Parameter names are timm's (``logit_scale``, ``cpb_mlp``, ``q_bias``, ``v_bias``)."""

    def __init__(self, dim: int, num_heads: int, table_window: tuple[int, int],
                 pretrained_window: tuple[int, int] | None = None, **kw) -> None:
        # the window the MLP's offsets are scaled to; None: the window in use (timm's pretrained_window_size 0)
        self.pretrained_window = None if pretrained_window is None else tuple(pretrained_window)
        super().__init__(dim, num_heads, table_window, **kw)

    def position_bias_params(self) -> None:
        self.logit_scale = nn.Parameter(torch.full((self.num_heads, 1, 1), math.log(10.0)))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 512), nn.ReLU(inplace=True),
                                     nn.Linear(512, self.num_heads, bias=False))

    def plan(self, window: tuple[int, int], gather: Tensor, mask: Tensor | None, num_windows: int) -> None:
        """The window layout (see :meth:`WindowAttention.plan`), and the offsets the MLP is read at, a buffer
        (not saved) that TorchScript can read."""
        super().plan(window, gather, mask, num_windows)
        offsets = log_spaced_offsets(self.rel_pos_window, self.pretrained_window or self.rel_pos_window)
        self.register_buffer("relative_coords_table", offsets.to(gather.device), persistent=False)

    def bias_table(self) -> Tensor:
        return 16 * torch.sigmoid(self.cpb_mlp(self.relative_coords_table))  # ((2·wh - 1)·(2·ww - 1), H)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, lead: list[int], bias: Tensor | None = None,
               attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, is_causal: bool = False,
               return_attn: bool = False) -> tuple[Tensor, Tensor | None]:
        """:meth:`Attention.attend` of cos(q, k) times the head's temperature: unit q (scaled) and k, scale 1."""
        temperature = torch.clamp(self.logit_scale, max=math.log(100.0)).exp()  # (H, 1, 1)
        o, attn = attention(F.normalize(q, dim=-1) * temperature, F.normalize(k, dim=-1), v, lead, bias, attn_mask,
                            key_padding_mask, is_causal, self.backend, 1.0,
                            self.attn_drop.p if self.training else 0.0, return_attn)  # (B·G, H, N, D)
        o = self.proj_drop(self.proj(o.transpose(1, 2).flatten(2)))  # (B·G, N, C)
        return o.unflatten(0, lead), attn  # (B, [G,] N, C)

    def set_table_window(self, window: tuple[int, int]) -> None:
        """Another window: the MLP is read at its offsets (re-planned by the stage)."""
        self.rel_pos_window = tuple(window)


class ResPostNormWindowBlock(WindowBlock):
    """Swin V2's block: the norms move to the end of each branch, x + norm1(attn(x)), then x + norm2(mlp(x)),
    which keeps the residual stream's activations small in deep, wide models."""

    def forward(self, x: Tensor, window: tuple[int, int] | None = None, attn_mask: Tensor | None = None,
                keep: Tensor | None = None) -> Tensor:
        """As :class:`~vitkit.layers.block.WindowBlock`'s; ``keep`` is always None here (Swin V2 masks its
        padding)."""
        if torch.jit.is_scripting() or window is None:
            bias = self.attn.planned_bias()
        else:
            bias = self.attn.relative_position_bias(window)[None, None]
        x = x + self.drop_path1(self.ls1(self.norm1(self.attn(x, bias, attn_mask))))
        return x + self.drop_path2(self.ls2(self.norm2(self.mlp(x))))
