"""Multi-scale deformable attention (Zhu et al., 2021, "Deformable DETR") and the query self-attention of DETR
decoders, whose queries and keys carry a position that the values do not.

Deformable attention is not q·kᵀ: each query predicts, per head, a few sampling points around its reference box and
a weight for each; the output is the weighted sum of the values read at those points by bilinear interpolation
(``grid_sample``). The plain PyTorch path below is the reference Deformable DETR and transformers run on a CPU and
export to ONNX (GridSample, opset 16).

Legend: B batch, Q queries, S memory tokens (the levels' maps, flattened), H heads, L levels, P points, D head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention


def deformable_sample(value: Tensor, shapes: list[tuple[int, int]], locations: Tensor, weights: Tensor) -> Tensor:
    """value (B, S, H, D), ``shapes`` the levels' (h, w), locations (B, Q, H, L, P, 2) in [0, 1] (x, y), weights
    (B, Q, H, L, P) -> (B, Q, H·D): each head's points read bilinearly (zeros outside), weighted and summed."""
    B, _, H, D = value.shape
    _, Q, _, L, P, _ = locations.shape
    grids = 2 * locations - 1  # grid_sample's [-1, 1]
    sampled = []
    for level, (part, (h, w)) in enumerate(zip(value.split([h * w for h, w in shapes], dim=1), shapes, strict=True)):
        maps = part.flatten(2).transpose(1, 2).reshape(B * H, D, h, w)  # (B·H, D, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)  # (B·H, Q, P, 2)
        sampled.append(F.grid_sample(maps, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    stacked = torch.stack(sampled, dim=-2).flatten(-2)  # (B·H, D, Q, L·P)
    w = weights.transpose(1, 2).reshape(B * H, 1, Q, L * P)
    return (stacked * w).sum(-1).view(B, H * D, Q).transpose(1, 2)  # (B, Q, H·D)


class DeformableAttention(nn.Module):
    """Deformable DETR's multi-scale deformable attention: ``points`` samples per head and level around each query's
    reference box (centre x, centre y, width, height in [0, 1]), offsets scaled by the box's half size, as LW-DETR
    and RF-DETR use it."""

    def __init__(self, dim: int, num_heads: int, levels: int = 1, points: int = 4) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads, self.levels, self.points = num_heads, levels, points
        self.sampling_offsets = nn.Linear(dim, num_heads * levels * points * 2)
        self.attention_weights = nn.Linear(dim, num_heads * levels * points)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deformable DETR's start: no learned offsets, each head's points on a ray of its own direction, uniform
        weights."""
        H, L, P = self.num_heads, self.levels, self.points
        nn.init.zeros_(self.sampling_offsets.weight)
        theta = torch.arange(H, dtype=torch.float32) * (2.0 * math.pi / H)
        grid = torch.stack([theta.cos(), theta.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(H, 1, 1, 2).repeat(1, L, P, 1)
        grid = grid * torch.arange(1, P + 1, dtype=torch.float32).view(1, 1, P, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for layer in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, query: Tensor, reference: Tensor, memory: Tensor, shapes: list[tuple[int, int]],
                padding: Tensor | None = None) -> Tensor:
        """query (B, Q, C), reference (B, Q, L, 4) boxes, memory (B, S, C) the levels' maps flattened, ``shapes``
        their (h, w), padding (B, S) True where the memory is padding -> (B, Q, C)."""
        B, Q, C = query.shape
        S, H, L, P = memory.shape[1], self.num_heads, self.levels, self.points
        if sum(h * w for h, w in shapes) != S or len(shapes) != L:
            raise ValueError(f"the memory's {S} tokens must be the {L} levels' maps {shapes} flattened")
        value = self.value_proj(memory)
        if padding is not None:
            value = value.masked_fill(padding[..., None], 0.0)
        value = value.view(B, S, H, C // H)  # (B, S, H, D)
        offsets = self.sampling_offsets(query).view(B, Q, H, L, P, 2)
        weights = self.attention_weights(query).view(B, Q, H, L * P).softmax(-1).view(B, Q, H, L, P)
        centre, size = reference[:, :, None, :, None, :2], reference[:, :, None, :, None, 2:]
        locations = centre + offsets / P * size * 0.5  # (B, Q, H, L, P, 2)
        return self.output_proj(deformable_sample(value, shapes, locations, weights))


class QuerySelfAttention(Attention):
    """The DETR decoder's self-attention on the one core: queries and keys from the queries plus their positions,
    values from the queries alone (DETR, Deformable DETR, LW-DETR); separate q, k, v projections."""

    def in_projections(self, dim: int, qkv_bias: bool | str) -> None:
        H, D = self.num_heads, self.head_dim
        self.q_proj = nn.Linear(dim, H * D, bias=qkv_bias is True)
        self.k_proj = nn.Linear(dim, H * D, bias=qkv_bias is True)
        self.v_proj = nn.Linear(dim, H * D, bias=qkv_bias is True)

    def forward(self, x: Tensor, pos: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """x (B, [G,] N, C) and its positions (broadcastable) -> (B, [G,] N, C); groups attend within themselves."""
        N, C, H, D = x.shape[-2], x.shape[-1], self.num_heads, self.head_dim
        qk = x if pos is None else x + pos
        heads = [proj(t.reshape(-1, N, C)).unflatten(-1, (H, D)).transpose(1, 2)  # (B·G, H, N, D)
                 for proj, t in ((self.q_proj, qk), (self.k_proj, qk), (self.v_proj, x))]
        return self.attend(*heads, x.shape[:-2])[0]
