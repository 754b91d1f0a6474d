"""A segmentation model over one image: the class of every pixel at the image's own size (the mask and overlay files
are ``vitkit/tools/masks.py``'s); the confusion matrix and scores, and ``vitkit evaluate``'s report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F

from vitkit.tools.masks import palette, save_mask  # noqa: F401 (this module's names, numpy's own there)


@torch.no_grad()
def predict_mask(model: torch.nn.Module, image: Image.Image, size: tuple[int, int], mean, std) -> np.ndarray:
    """The class index of each pixel of ``image`` (H, W): the image resized to the model's ``size`` and normalised,
    the logits resized back to the image's size (bilinear) before the argmax."""
    rgb = np.asarray(image.convert("RGB").resize((size[1], size[0]), Image.BILINEAR), dtype=np.float32) / 255
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    device = next(model.parameters()).device
    logits = model(x.to(device)).float()
    logits = F.interpolate(logits, size=(image.height, image.width), mode="bilinear", align_corners=False)
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
    (index in the split, mIoU, the normalised image, its mask, the prediction)."""
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
