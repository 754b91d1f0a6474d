"""The weights of PyTorch's antialiased resize (``F.interpolate(..., antialias=True)``, bilinear and bicubic) as a
function of tensors: the resize of learned positions to each image's own grid in a traced graph where the grids are
data (``deploy/export_packed.py``). One axis; the 2-D resize is separable."""

from __future__ import annotations

import torch
from torch import Tensor

from vitkit.errors import UsageError

_AA_TAPS = {"bilinear": 2, "bicubic": 4}  # the antialiased filters' support, in input samples at scale 1


def _aa_filter(x: Tensor, mode: str) -> Tensor:
    """PyTorch's antialiased filters: the triangle, and the cubic with a = -0.5 (PIL's, not plain bicubic's -0.75)."""
    x = x.abs()
    if mode == "bilinear":
        return (1 - x).clamp(min=0)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def resample_weights(index: Tensor, out_size: Tensor, in_size: int, mode: str = "bicubic") -> Tensor:
    """The weights ``F.interpolate(..., mode, antialias=True, align_corners=False)`` gives the ``in_size`` input
    samples for output sample ``index`` of ``out_size`` (integer tensors of one shape): (*index.shape, in_size).
    Sizes and indices are tensors, so a traced graph computes the weights of any output size (a packed batch's
    per-image grids); one axis of the separable 2-D resize."""
    if mode not in _AA_TAPS:
        raise UsageError(f"resample_weights takes the antialiased {' or '.join(_AA_TAPS)} resize, got {mode!r}")
    scale = in_size / out_size.float()  # area_pixel_compute_scale without align_corners
    support = _AA_TAPS[mode] * 0.5 * scale.clamp(min=1)
    inv = 1 / scale.clamp(min=1)
    center = scale * (index.float() + 0.5)
    first = (center - support + 0.5).trunc().clamp(min=0)  # ATen's int64 casts truncate
    end = (center + support + 0.5).trunc().clamp(max=in_size)
    j = torch.arange(in_size, device=index.device, dtype=torch.float32)
    w = _aa_filter((j - center[..., None] + 0.5) * inv[..., None], mode)
    w = torch.where((j >= first[..., None]) & (j < end[..., None]), w, torch.zeros_like(w))
    return w / w.sum(-1, keepdim=True)
