"""A segmentation model over one image: the class of every pixel at the image's own size (the mask and overlay files
are ``vitkit/masks.py``'s); the confusion matrix and scores, and ``vitkit evaluate``'s report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F

from vitkit.errors import UsageError
from vitkit.masks import palette, save_mask, slide_stride, windows  # noqa: F401 (numpy's own there)

MODES = ("whole", "slide")


@torch.no_grad()
def segment_logits(model: torch.nn.Module, x: torch.Tensor, size: tuple[int, int], mode: str = "whole",
                   stride: tuple[int, int] | None = None) -> torch.Tensor:
    """The logits (B, classes, H, W) of a normalised batch ``x`` (B, 3, H, W) at its own size.

    ``whole``: ``x`` resized to the model's ``size``, the logits resized back. ``slide``: windows of the model's size
    over ``x`` as it is, ``stride`` apart (default two thirds of the size), the logits of overlapping windows
    averaged (mmsegmentation's ``slide`` mode); a window past a short side is padded and its padding cut away."""
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    h, w = x.shape[-2:]
    if mode == "whole":
        logits = model(F.interpolate(x, size=size, mode="bilinear", align_corners=False)).float()
        return F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
    sh, sw = slide_stride(size, stride)
    total, count = None, torch.zeros(1, 1, h, w, device=x.device)
    for top, bottom in windows(h, size[0], sh):
        for left, right in windows(w, size[1], sw):
            crop = x[..., top:bottom, left:right]
            padded = F.pad(crop, (0, size[1] - crop.shape[-1], 0, size[0] - crop.shape[-2]))
            out = model(padded).float()[..., :crop.shape[-2], :crop.shape[-1]]
            total = torch.zeros(x.shape[0], out.shape[1], h, w, device=x.device) if total is None else total
            total[..., top:bottom, left:right] += out
            count[..., top:bottom, left:right] += 1
    return total / count


@torch.no_grad()
def predict_mask(model: torch.nn.Module, image: Image.Image, size: tuple[int, int], mean, std, mode: str = "whole",
                 stride: tuple[int, int] | None = None) -> np.ndarray:
    """The class index of each pixel of ``image`` (H, W), the logits at the image's size (``segment_logits``)."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255
    if mode == "whole":  # resized by PIL, as the data modules and the ONNX path do
        rgb = np.asarray(image.convert("RGB").resize((size[1], size[0]), Image.BILINEAR), dtype=np.float32) / 255
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    x = x.to(next(model.parameters()).device)
    if mode == "whole":  # already at the model's size
        logits = F.interpolate(model(x).float(), size=(image.height, image.width), mode="bilinear",
                               align_corners=False)
    else:
        logits = segment_logits(model, x, size, mode, stride)
    return logits.argmax(1)[0].cpu().numpy()


def confusion(pred: np.ndarray, label: np.ndarray, classes: int, ignore_index: int) -> np.ndarray:
    """(classes, classes) pixel counts, rows the label, columns the prediction; ``ignore_index`` pixels left out."""
    keep = label != ignore_index
    flat = label[keep].astype(np.int64) * classes + pred[keep].astype(np.int64)
    return np.bincount(flat, minlength=classes * classes).reshape(classes, classes)


def scores(count: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(IoU per class, NaN where a class is neither labelled nor predicted; mIoU over the others; pixel accuracy)."""
    hits = np.diag(count).astype(np.float64)
    union = count.sum(0) + count.sum(1) - hits
    iou = np.full(len(hits), np.nan)
    np.divide(hits, union, out=iou, where=union > 0)
    total = count.sum()
    return iou, float(np.nanmean(iou)) if (union > 0).any() else 0.0, float(hits.sum() / total) if total else 0.0


@torch.no_grad()
def evaluate_masks(model: torch.nn.Module, loader, classes: int, ignore_index: int, device: torch.device,
                   prepare=lambda batch: batch, worst: int = 8) -> dict:
    """The confusion matrix over a loader of (image batch, mask batch), and the ``worst`` images by their own mIoU
    (index in the split, mIoU, the normalised image, its mask, the prediction). ``model`` maps a batch to logits at
    its size (a segmenter, or ``segment_logits`` around one)."""
    total = np.zeros((classes, classes), np.int64)
    per_image: list[tuple[float, int, torch.Tensor, np.ndarray, np.ndarray]] = []
    seen = 0
    for batch in loader:
        x, y = prepare(batch)
        pred = model(x.to(device)).argmax(1).cpu().numpy()
        label = y.cpu().numpy()
        for i in range(len(pred)):
            count = confusion(pred[i], label[i], classes, ignore_index)
            total += count
            per_image.append((scores(count)[1], seen + i, x[i].cpu(), label[i], pred[i]))
        per_image = sorted(per_image, key=lambda t: t[0])[:worst]
        seen += len(pred)
    return {"confusion": total, "samples": seen, "worst": per_image}


def write_segmentation_report(result: dict, names: list[str], out: Path, mean, std, extra: dict) -> dict:
    """``metrics.json`` (mIoU, pixel accuracy, IoU per class: null for a class in neither the labels nor the
    predictions), ``confusion_matrix.csv`` and ``worst/`` (image | label | prediction, the lowest mIoU first)."""
    import csv
    import json

    out.mkdir(parents=True, exist_ok=True)
    iou, miou, acc = scores(result["confusion"])
    metrics = {**extra, "samples": result["samples"], "classes": len(names), "mIoU": miou, "pixel_acc": acc,
               "per_class_iou": {n: None if np.isnan(v) else float(v) for n, v in zip(names, iou, strict=True)}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    with open(out / "confusion_matrix.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label \\ predicted", *names])
        writer.writerows([name, *row] for name, row in zip(names, result["confusion"].tolist(), strict=True))
    colours = palette(max(len(names), 1))
    (out / "worst").mkdir(exist_ok=True)
    m, s = np.asarray(mean).reshape(3, 1, 1), np.asarray(std).reshape(3, 1, 1)
    for rank, (score, index, x, label, pred) in enumerate(result["worst"]):
        image = ((x.float().numpy() * s + m).clip(0, 1) * 255).astype(np.uint8).transpose(1, 2, 0)
        shown = np.where(label[..., None] < len(names), colours[label.clip(0, len(names) - 1)], 255)
        row = np.concatenate([image, shown.astype(np.uint8), colours[pred]], axis=1)
        Image.fromarray(row).save(out / "worst" / f"{rank:02d}_image{index:05d}_miou{score:.3f}.png")
    return metrics
