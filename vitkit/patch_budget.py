"""The size an image takes within a patch budget at its own aspect ratio (timm NaFlex's rule), with no import of
torch: the ONNX runner (``onnx_model``) prepares images by it as ``--data.packing`` does."""

from __future__ import annotations

import math

from vitkit.errors import UsageError


def budget_size(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """Where a NaFlex loader resizes an image of ``height`` x ``width`` to: the largest scale at which the sides,
    each rounded up to whole patches (at least one), hold at most ``max_patches`` patches (timm's
    ``get_image_size_for_seq``)."""
    if max_patches < 1:
        raise UsageError(f"max_patches must be >= 1, got {max_patches}")

    def grid(scale: float) -> tuple[int, int]:
        return max(1, math.ceil(height * scale / patch_size)), max(1, math.ceil(width * scale / patch_size))

    low, high = 0.0, 1.0
    while grid(high)[0] * grid(high)[1] <= max_patches:
        low, high = high, high * 2
    for _ in range(60):  # the patch counts only change at ``max_patches`` scales: bisect to the last that fits
        mid = (low + high) / 2
        low, high = (mid, high) if grid(mid)[0] * grid(mid)[1] <= max_patches else (low, mid)
    rows, cols = grid(low)
    return rows * patch_size, cols * patch_size
