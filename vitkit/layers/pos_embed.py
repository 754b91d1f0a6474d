"""Position embeddings: fixed 2-D sin-cos, 1-D sinusoidal, and resampling of learned ones."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def sinusoidal_1d(num_positions: int, dim: int, base: float = 10000.0) -> Tensor:
    """Vaswani et al. (2017): PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(...); (P, dim)."""
    if dim % 2:
        raise ValueError(f"sinusoidal embedding needs an even dim, got {dim}")
    pos = torch.arange(num_positions, dtype=torch.float32)[:, None]  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(base) / dim))  # (dim/2,)
    pe = torch.empty(num_positions, dim)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq)
    return pe


def sincos_2d(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos embedding (MAE, He et al., 2022): half the channels encode the row, half the
    column; returns (h·w, dim) in row-major patch order."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs dim divisible by 4, got {dim}")
    h, w = grid_size
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))  # (dim/4,)
    ang_y, ang_x = ys.flatten()[:, None] * omega, xs.flatten()[:, None] * omega  # (h·w, dim/4)
    return torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], dim=1)


def resample_abs_pos_embed(
    pos_embed: Tensor,
    new_size: tuple[int, int],
    old_size: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resize a learned (1, prefix + h·w, C) embedding to a new patch grid; prefix tokens are kept.

    Interpolates in float32 like timm's loader, so a checkpoint resized here matches one resized there."""
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"cannot infer a square grid from {n} position tokens; pass old_size")
        old_size = (side, side)
    if old_size[0] * old_size[1] != n:
        raise ValueError(f"old_size {old_size} does not match {n} position tokens")
    if tuple(old_size) == tuple(new_size):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    C, dtype = grid.shape[-1], grid.dtype
    grid = grid.float().reshape(1, *old_size, C).permute(0, 3, 1, 2)  # (1, C, h, w)
    grid = F.interpolate(grid, size=tuple(new_size), mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, C).to(dtype)  # (1, h'·w', C)
    return torch.cat([prefix, grid], dim=1)
