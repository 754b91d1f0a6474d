"""Position embeddings: fixed 2-D sin-cos, 1-D sinusoidal, resampling of learned ones, and rotary (1-D and 2-D)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError


def sinusoidal_1d(num_positions: int, dim: int, base: float = 10000.0) -> Tensor:
    """Vaswani et al. (2017): PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(...); (P, dim)."""
    if dim % 2:
        raise UsageError(f"sinusoidal embedding needs an even dim, got {dim}")
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
        raise UsageError(f"2-D sin-cos embedding needs dim divisible by 4, got {dim}")
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
    crop: tuple[int, int] | None = None,
) -> Tensor:
    """Resize a learned (1, prefix + h·w, C) embedding to a new patch grid; prefix tokens are kept. With ``crop``,
    only the resized grid's first rows and columns (timm NaFlexViT's aspect-preserving positions).

    Interpolates in float32 like timm's loader, so a checkpoint resized here matches one resized there."""
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(n)
        if side * side != n:
            raise UsageError(f"cannot infer a square grid from {n} position tokens; pass old_size")
        old_size = (side, side)
    if old_size[0] * old_size[1] != n:
        raise UsageError(f"old_size {old_size} does not match {n} position tokens")
    symbolic = any(isinstance(s, torch.SymInt) for s in new_size)  # traced for export: comparing would pin the size
    if not symbolic and tuple(old_size) == tuple(new_size):
        if crop is None or tuple(crop) == tuple(new_size):
            return pos_embed
        prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
        grid = grid.reshape(1, old_size[0], old_size[1], -1)[:, :crop[0], :crop[1]]
        return torch.cat([prefix, grid.reshape(1, crop[0] * crop[1], -1)], dim=1)
    return resize_pos_grid(pos_embed, new_size, old_size, num_prefix_tokens, interpolation, antialias, crop)


def resize_pos_grid(pos_embed: Tensor, new_size: tuple[int, int], old_size: tuple[int, int], num_prefix_tokens: int,
                    interpolation: str = "bicubic", antialias: bool = True,
                    crop: tuple[int, int] | None = None) -> Tensor:
    """The resize itself, sizes given (TorchScript compiles it: a scripted dynamic-size ViT calls it)."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    C, dtype = grid.shape[-1], grid.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], C).permute(0, 3, 1, 2)  # (1, C, h, w)
    grid = F.interpolate(grid, size=[new_size[0], new_size[1]], mode=interpolation, antialias=antialias)
    if crop is not None:
        grid = grid[:, :, :crop[0], :crop[1]]
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, C).to(dtype)  # (1, h'·w', C)
    return torch.cat([prefix, grid], dim=1)


def _geometric_positions(src: int, dst: int) -> Tensor:
    """Source offsets -(src//2)..src//2 spread out geometrically so the outermost lands near dst//2.

    Near offsets keep unit spacing and far ones stretch (BEiT's scheme, which timm uses for Swin), so a
    table trained for a small window keeps its fine detail where attention is strongest."""
    n, target = src // 2, dst // 2
    lo, hi = 1.01, 1.5
    while hi - lo > 1e-6:  # bisect the ratio q of 1 + q + ... + q^(n-1) = target
        q = (lo + hi) / 2
        if (1 - q**n) / (1 - q) > target:
            hi = q
        else:
            lo = q
    dist = torch.tensor([sum(q**j for j in range(i + 1)) for i in range(n)], dtype=torch.float64)
    return torch.cat([-dist.flip(0), torch.zeros(1, dtype=torch.float64), dist])


def _linear_weights(src_pos: Tensor, dst_pos: Tensor) -> Tensor:
    """(D, S) matrix of linear interpolation from points src_pos to dst_pos, clamped at the ends."""
    x = dst_pos.clamp(src_pos[0], src_pos[-1])
    right = torch.searchsorted(src_pos, x).clamp(1, len(src_pos) - 1)
    left = right - 1
    t = (x - src_pos[left]) / (src_pos[right] - src_pos[left])
    w = torch.zeros(len(dst_pos), len(src_pos), dtype=torch.float64)
    w[torch.arange(len(dst_pos)), left] = 1 - t
    w[torch.arange(len(dst_pos)), right] += t
    return w


def resize_rel_pos_table(table: Tensor, new_window: tuple[int, int],
                         old_window: tuple[int, int] | None = None) -> Tensor:
    """Resize a Swin relative-position bias table ((2W-1)², heads) to ``new_window``.

    Without ``old_window`` the source window is taken as square unless the table size rules that out,
    as in timm's loader, and the result matches timm's resized load."""
    L, heads = table.shape
    dst = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    side = math.isqrt(L)
    if old_window is not None:
        src = (2 * old_window[0] - 1, 2 * old_window[1] - 1)
    elif side * side == L:
        src = (side, side)
    elif L == dst[0] * dst[1]:
        src = dst
    else:
        raise UsageError(f"cannot tell the window of a relative-position table with {L} rows")
    if src == dst:
        return table
    wy = _linear_weights(_geometric_positions(src[0], dst[0]),
                         torch.arange(-(dst[0] // 2), dst[0] // 2 + 1, dtype=torch.float64))
    wx = _linear_weights(_geometric_positions(src[1], dst[1]),
                         torch.arange(-(dst[1] // 2), dst[1] // 2 + 1, dtype=torch.float64))
    grid = table.double().T.reshape(heads, *src)  # (heads, src_h, src_w)
    out = wy @ grid @ wx.T  # (heads, dst_h, dst_w); bilinear is separable
    return out.reshape(heads, -1).T.to(table.dtype).contiguous()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (Su et al., 2021): rotate pairs of channels by position angles. cos/sin (N, D/2)
    pair (x[i], x[i + D/2]) (the rotate-half layout); (N, D), each angle twice in a row, pair (x[2i], x[2i+1]) (the
    interleaved layout of RoFormer and timm's axial ViT RoPE)."""
    if cos.shape[-1] == x.shape[-1]:  # interleaved: (x0, x1) -> (x0·c - x1·s, x1·c + x0·s), and so on
        rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
        return (x * cos + rotated * sin).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_2d(height: int, width: int, head_dim: int, temperature: float, num_prefix: int,
            device: torch.device) -> tuple[Tensor, Tensor]:
    """2-D rotary tables of DINOv3 (Siméoni et al., 2025) for an h x w patch grid: patch centres normalised to
    [-1, 1] on each axis; of each head's D/2 rotated pairs the first D/4 turn with the row and the last D/4 with
    the column, at periods temperature^(4i/D). Returns (cos, sin), each (prefix + h·w, D/2) for
    :func:`apply_rope`; the prefix tokens (class, registers) get the identity rotation (cos 1, sin 0)."""
    rows, cols = _grid_cells(height, width)
    angles = rope_2d_angles(rows, cols, torch.full_like(rows, height), torch.full_like(cols, width), head_dim,
                            temperature)
    angles = torch.cat([angles.new_zeros(num_prefix, head_dim // 2), angles]).to(device)  # (prefix + h·w, D/2)
    return angles.cos(), angles.sin()


def _grid_cells(height: int, width: int) -> tuple[Tensor, Tensor]:
    """Each patch's row and column of an h x w grid, row by row: (h·w,) each."""
    rows = torch.arange(height)[:, None].expand(height, width).reshape(-1)
    return rows, torch.arange(width)[None, :].expand(height, width).reshape(-1)


def rope_2d_angles(rows: Tensor, cols: Tensor, height: Tensor, width: Tensor, head_dim: int,
                   temperature: float) -> Tensor:
    """:func:`rope_2d`'s angles (..., D/2) of patches at ``rows`` and ``cols`` of grids ``height`` x ``width``
    (integer tensors of one shape: a packed batch's slots have grids of their own)."""
    if head_dim % 4:
        raise UsageError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    periods = temperature ** (2.0 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))  # (D/4,)
    ys = (rows.float() + 0.5) / height * 2.0 - 1.0  # patch centres in [-1, 1]
    xs = (cols.float() + 0.5) / width * 2.0 - 1.0
    periods = periods.to(ys.device)
    return torch.cat([2 * math.pi * ys[..., None] / periods, 2 * math.pi * xs[..., None] / periods], dim=-1)


def rope_axial(height: int, width: int, head_dim: int, temperature: float, num_prefix: int, device: torch.device,
               xy: bool = False, ref_grid: int | None = None) -> tuple[Tensor, Tensor]:
    """Axial 2-D rotary tables of timm's RoPE ViTs (Heo et al., 2024) and EVA-02, in the interleaved layout: patch
    indices (rescaled to a ``ref_grid`` when given, EVA's fine-tuning rule) times D/4 inverse frequencies
    temperature^(-4i/D), the row's then the column's (the column's first with ``xy``), each angle used for two
    adjacent channels. Returns (cos, sin), each (prefix + h·w, D), identity rows for the prefix tokens."""
    rows, cols = _grid_cells(height, width)
    angles = rope_axial_angles(rows, cols, torch.full_like(rows, height), torch.full_like(cols, width), head_dim,
                               temperature, xy, ref_grid)
    angles = torch.cat([angles.new_zeros(num_prefix, head_dim), angles]).to(device)  # (prefix + h·w, D)
    return angles.cos(), angles.sin()


def rope_axial_angles(rows: Tensor, cols: Tensor, height: Tensor, width: Tensor, head_dim: int,
                      temperature: float, xy: bool = False, ref_grid: int | None = None) -> Tensor:
    """:func:`rope_axial`'s angles (..., D) of patches at ``rows`` and ``cols`` of grids ``height`` x ``width``
    (as :func:`rope_2d_angles`)."""
    if head_dim % 4:
        raise UsageError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    bands = 1.0 / temperature ** (torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 4))  # (D/4,)
    ys, xs = rows.float(), cols.float()
    if ref_grid is not None:
        ys, xs = ys / height * ref_grid, xs / width * ref_grid
    first, second = (xs, ys) if xy else (ys, xs)
    bands = bands.to(ys.device)
    return torch.cat([first[..., None] * bands, second[..., None] * bands], dim=-1).repeat_interleave(2, dim=-1)


class RopeMixed(nn.Module):
    """The learned frequencies of RoPE-Mixed (Heo et al., 2024): in every block each head turns its D/2 channel
    pairs by x·f_x + y·f_y, with (f_x, f_y) trained. ``freqs`` (2, depth, heads, D/2) is timm's ``rope.freqs``,
    initialised at the axial magnitudes temperature^(-4i/D) in one random direction per head and block (the
    second half of the pairs a quarter turn from the first). :func:`rope_mixed` makes the tables."""

    def __init__(self, depth: int, num_heads: int, head_dim: int, temperature: float = 10.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise UsageError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
        mag = temperature ** (-torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)  # (D/4,)
        turn = torch.rand(depth, num_heads, 1) * 2 * math.pi
        fx = torch.cat([mag * turn.cos(), mag * (turn + math.pi / 2).cos()], dim=-1)  # (depth, heads, D/2)
        fy = torch.cat([mag * turn.sin(), mag * (turn + math.pi / 2).sin()], dim=-1)
        self.freqs = nn.Parameter(torch.stack([fx, fy]))


def rope_mixed(freqs: Tensor, height: int, width: int, num_prefix: int) -> tuple[Tensor, Tensor]:
    """Tables of :class:`RopeMixed` for an h x w patch grid (column index x, row index y): (cos, sin), each
    (depth, heads, prefix + h·w, D) in the interleaved layout, identity rows for the prefix tokens. Angles are
    computed in float32 whatever the parameter's dtype."""
    f = freqs.float()
    ys = torch.arange(height, dtype=torch.float32, device=f.device)[:, None].expand(height, width).reshape(-1)
    xs = torch.arange(width, dtype=torch.float32, device=f.device)[None, :].expand(height, width).reshape(-1)
    angles = xs[:, None] * f[0][:, :, None, :] + ys[:, None] * f[1][:, :, None, :]  # (depth, heads, h·w, D/2)
    angles = angles.repeat_interleave(2, dim=-1)
    angles = torch.cat([angles.new_zeros(f.shape[1], f.shape[2], num_prefix, angles.shape[-1]), angles], dim=2)
    return angles.cos(), angles.sin()


# torch.fx traces through rope_tables (its branch is on the config) and keeps each table builder as one node: the
# tables depend on the input's grid
torch.fx.wrap("rope_2d")
torch.fx.wrap("rope_axial")
torch.fx.wrap("rope_mixed")


def rope_tables(kind: str, grid: tuple[int, int], head_dim: int, temperature: float, num_prefix: int,
                device: torch.device, xy: bool = False, ref_grid: int | None = None,
                freqs: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """A ViT's RoPE tables for a patch grid: DINOv3's, axial, or with learned frequencies (``freqs``, RoPE-Mixed:
    (depth, heads, prefix + h·w, D) each, block i takes row i); None without RoPE."""
    if kind == "dinov3":
        return rope_2d(grid[0], grid[1], head_dim, temperature, num_prefix, device)
    if kind == "axial":
        return rope_axial(grid[0], grid[1], head_dim, temperature, num_prefix, device, xy, ref_grid)
    if freqs is not None:
        return rope_mixed(freqs, grid[0], grid[1], num_prefix)
    return None


def keep_tokens(x: Tensor, rope: tuple[Tensor, Tensor] | None, keep: Tensor,
                num_prefix: int) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """Of tokens (B, prefix + N, C), the prefix and the patches ``keep`` (B, K) indexes, in that order, and their
    rows of the RoPE tables, which become per sample: (B, 1, prefix + K, D') for shared tables, (depth, B, heads,
    prefix + K, D') for per-block ones."""
    B, _, C = x.shape
    patches = x[:, num_prefix:].gather(1, keep[..., None].expand(-1, -1, C))  # (B, K, C)
    x = torch.cat([x[:, :num_prefix], patches], dim=1)
    rows = torch.cat([torch.arange(num_prefix, device=keep.device).expand(B, -1), keep + num_prefix], dim=1)
    return x, rope_rows(rope, rows)


def rope_rows(rope: tuple[Tensor, Tensor] | None, rows: Tensor) -> tuple[Tensor, Tensor] | None:
    """RoPE tables of sequences made of a ViT's tokens: ``rows`` (S, L) the token indices of each sequence ->
    per-sequence tables, (S, 1, L, D') for shared tables, (depth, S, heads, L, D') for per-block ones."""
    if rope is None:
        return None
    if rope[0].dim() == 2:  # (prefix + N, D') shared by every block and head
        return rope[0][rows][:, None], rope[1][rows][:, None]
    return rope[0][:, :, rows].transpose(1, 2), rope[1][:, :, rows].transpose(1, 2)
