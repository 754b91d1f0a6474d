"""Masks without torch: logits resized as PyTorch's bilinear resize does, a class per pixel, the mask as a palette
PNG and an overlay of it on the image. ``vitkit predict --onnx`` of a segmenter runs on these and onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def palette(n: int) -> np.ndarray:
    """(n, 3) uint8 colours, Pascal VOC's (class 0 black), which tell neighbouring classes apart."""
    out = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for bit in range(8):
            r |= ((c >> 0) & 1) << (7 - bit)
            g |= ((c >> 1) & 1) << (7 - bit)
            b |= ((c >> 2) & 1) << (7 - bit)
            c >>= 3
        out[i] = (r, g, b)
    return out


def resize_bilinear(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(C, h, w) -> (C, H, W), bilinear with corners not aligned: ``F.interpolate(mode="bilinear",
    align_corners=False)``'s sampling, in numpy."""
    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(np.int64)
        return lo, np.minimum(lo + 1, n_in - 1), (src - lo).astype(x.dtype)

    (top, bottom, fy), (left, right, fx) = taps(x.shape[1], size[0]), taps(x.shape[2], size[1])
    rows = x[:, top] * (1 - fy)[:, None] + x[:, bottom] * fy[:, None]
    return rows[:, :, left] * (1 - fx) + rows[:, :, right] * fx


def mask_of(logits: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The class of each pixel (H, W) from one image's logits (C, h, w), resized to ``size`` first."""
    return resize_bilinear(logits.astype(np.float32), size).argmax(0)


def save_mask(mask: np.ndarray, image: Image.Image, stem: Path, classes: int) -> tuple[Path, Path]:
    """``<stem>_mask.png`` (a palette PNG whose pixel values are the class indices; 16-bit past 256 classes)
    and ``<stem>_overlay.png`` (the image with each class's colour blended in at half strength)."""
    colours = palette(max(classes, 1))
    if classes <= 256:
        out = Image.fromarray(mask.astype(np.uint8), mode="P")
        out.putpalette(colours.ravel().tolist())
    else:  # more classes than a palette holds: 16-bit indices, no colours
        out = Image.fromarray(mask.astype(np.uint16))
    mask_path, overlay_path = stem.with_name(stem.name + "_mask.png"), stem.with_name(stem.name + "_overlay.png")
    out.save(mask_path)
    blend = 0.5 * np.asarray(image.convert("RGB"), np.float32) + 0.5 * colours[mask].astype(np.float32)
    Image.fromarray(blend.clip(0, 255).astype(np.uint8)).save(overlay_path)
    return mask_path, overlay_path
