"""Masks without torch: logits resized as PyTorch's bilinear resize does, a class per pixel, the mask as a palette
PNG and an overlay of it on the image. ``vitkit predict --onnx`` of a segmenter runs on these and onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from vitkit.errors import UsageError


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


def mask_image(mask: np.ndarray, classes: int):
    """A mask (H, W) of class indices as a PIL image: a palette PNG whose pixel values are the indices (16-bit past 256
    classes, without colours)."""
    if classes <= 256:
        out = Image.fromarray(mask.astype(np.uint8), mode="P")
        out.putpalette(palette(max(classes, 1)).ravel().tolist())
        return out
    return Image.fromarray(mask.astype(np.uint16))


def overlay_image(mask: np.ndarray, image, classes: int):
    """The image with each class's colour blended in at half strength, but class 0's: the palette's black, the
    background of VOC's convention, leaves the image as it is rather than darken it."""
    rgb = np.asarray(image.convert("RGB"), np.float32)
    colours = palette(max(classes, 1))
    blend = np.where((mask > 0)[..., None], 0.5 * rgb + 0.5 * colours[mask].astype(np.float32), rgb)
    return Image.fromarray(blend.clip(0, 255).astype(np.uint8))


def save_mask(mask: np.ndarray, image: Image.Image, stem: Path, classes: int) -> tuple[Path, Path]:
    """``<stem>_mask.png`` (:func:`mask_image`) and ``<stem>_overlay.png`` (:func:`overlay_image`)."""
    mask_path, overlay_path = stem.with_name(stem.name + "_mask.png"), stem.with_name(stem.name + "_overlay.png")
    mask_image(mask, classes).save(mask_path)
    overlay_image(mask, image, classes).save(overlay_path)
    return mask_path, overlay_path


def windows(length: int, crop: int, stride: int) -> list[tuple[int, int]]:
    """(start, end) of the windows along one side, mmsegmentation's ``slide_inference`` grid: ``stride`` apart, the
    last one ending at the side's end; one window shorter than ``crop`` where the side is."""
    count = max(length - crop + stride - 1, 0) // stride + 1
    return [(max(min(i * stride + crop, length) - crop, 0), min(i * stride + crop, length)) for i in range(count)]


def slide_stride(size: tuple[int, int], stride: tuple[int, int] | None) -> tuple[int, int]:
    """The windows' step: ``stride``, or two thirds of the model's ``size``; a step of 0 or past the size refused."""
    sh, sw = stride or (max(1, size[0] * 2 // 3), max(1, size[1] * 2 // 3))
    if sh < 1 or sw < 1 or sh > size[0] or sw > size[1]:
        raise UsageError(f"stride must be from 1 to the model's size {size[0]}x{size[1]}, got {sh}x{sw}")
    return sh, sw


def slide_logits(run, x: np.ndarray, size: tuple[int, int], stride: tuple[int, int] | None = None) -> np.ndarray:
    """``segment_logits``' ``slide`` mode in numpy, for a model ``run`` on float32 arrays (onnxruntime): windows of
    the model's ``size`` over the normalised batch ``x`` (B, 3, H, W), each padded with zeros to the size where the
    image is shorter, the logits of overlapping windows averaged."""
    sh, sw = slide_stride(size, stride)
    h, w = x.shape[-2:]
    total, count = None, np.zeros((1, 1, h, w), np.float32)
    for top, bottom in windows(h, size[0], sh):
        for left, right in windows(w, size[1], sw):
            crop = x[..., top:bottom, left:right]
            padded = np.pad(crop, ((0, 0), (0, 0), (0, size[0] - crop.shape[-2]), (0, size[1] - crop.shape[-1])))
            out = run(np.ascontiguousarray(padded, dtype=np.float32))[..., :crop.shape[-2], :crop.shape[-1]]
            total = np.zeros((x.shape[0], out.shape[1], h, w), np.float32) if total is None else total
            total[..., top:bottom, left:right] += out
            count[..., top:bottom, left:right] += 1
    return total / count
