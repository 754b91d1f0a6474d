"""Detection scores as the field computes them: COCO's AP over IoU 0.50:0.95, AP50, AP75, AP of small, medium and
large objects and AR at 1, 10 and 100 detections, by torchmetrics' ``MeanAveragePrecision`` on COCO's own evaluation
code (faster-coco-eval where it is installed, else pycocotools: the same numbers), summed over every rank; per-class
AP beside them. Boxes are corners in the image's own pixels (COCO's areas decide small, medium and large)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vitkit.errors import MissingPackageError

SCORES = {"map": "mAP", "map_50": "AP50", "map_75": "AP75", "map_small": "AP_small", "map_medium": "AP_medium",
          "map_large": "AP_large", "mar_1": "AR1", "mar_10": "AR10", "mar_100": "AR100"}


def backend() -> str:
    """The COCO evaluation code installed: faster-coco-eval, else pycocotools."""
    for name, module in (("faster_coco_eval", "faster_coco_eval"), ("pycocotools", "pycocotools")):
        if importlib.util.find_spec(module) is not None:
            return name
    raise MissingPackageError("detection scores need COCO's evaluation code: pip install pycocotools (or "
                              "faster-coco-eval; pip install 'vitkit[detection]')")


def average_precision(class_metrics: bool = False):
    """torchmetrics' ``MeanAveragePrecision`` for boxes in corners, on the installed COCO evaluation code."""
    import numpy as np
    from torchmetrics.detection import MeanAveragePrecision

    # COCOeval's own thresholds, in float64: torchmetrics' defaults are float32 (0.3 of recall is 0.30000001), which
    # moves a precision that falls on a recall point
    return MeanAveragePrecision(box_format="xyxy", iou_type="bbox", class_metrics=class_metrics, backend=backend(),
                                iou_thresholds=np.linspace(0.5, 0.95, 10).tolist(),
                                rec_thresholds=np.linspace(0.0, 1.0, 101).tolist())


def scores(result: dict[str, Tensor], class_names: list[str] | None = None) -> dict[str, float]:
    """``MeanAveragePrecision.compute()``'s result as named floats (``mAP``, ``AP50``, ... and ``AP/<class>`` where
    it scored classes); -1 where COCO's evaluation has nothing to score (no object of that size)."""
    out = {name: float(result[key]) for key, name in SCORES.items() if key in result}
    per_class, classes = result.get("map_per_class"), result.get("classes")
    if per_class is not None and classes is not None and per_class.numel() > 1:
        for c, ap in zip(classes.reshape(-1).tolist(), per_class.reshape(-1).tolist(), strict=True):
            name = class_names[c] if class_names and 0 <= c < len(class_names) else str(c)
            out[f"AP/{name}"] = float(ap)
    return out


def coco_files(predictions: list[dict[str, Tensor]], truths: list[dict[str, Tensor]], sizes: list[tuple[int, int]],
               class_names: list[str], folder: str | os.PathLike, file_names: list[str] | None = None) -> None:
    """The split's truth as a COCO annotation file (``truth.json``) and the predictions in COCO's result format
    (``predictions.json``: image_id, category_id, bbox as x, y, width, height, score), category ids from 1 in the
    order of ``class_names``: what ``pycocotools.COCOeval`` and any other COCO tool read."""
    images, annotations, results = [], [], []
    for i, (pred, truth, (h, w)) in enumerate(zip(predictions, truths, sizes, strict=True)):
        images.append({"id": i + 1, "width": int(w), "height": int(h),
                       "file_name": file_names[i] if file_names else f"{i + 1}.jpg"})
        for box, label, crowd in zip(truth["boxes"].tolist(), truth["labels"].tolist(),
                                     truth.get("iscrowd", torch.zeros(len(truth["labels"]))).tolist(), strict=True):
            bw, bh = box[2] - box[0], box[3] - box[1]
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": int(label) + 1,
                                "bbox": [box[0], box[1], bw, bh], "area": bw * bh, "iscrowd": int(crowd)})
        results += [{"image_id": i + 1, "category_id": int(label) + 1,
                     "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "score": float(score)}
                    for box, label, score in zip(pred["boxes"].tolist(), pred["labels"].tolist(),
                                                 pred["scores"].tolist(), strict=True)]
    truth_file: dict[str, Any] = {"images": images, "annotations": annotations,
                                  "categories": [{"id": i + 1, "name": n} for i, n in enumerate(class_names)]}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "truth.json"), "w") as f:
        json.dump(truth_file, f)
    with open(os.path.join(folder, "predictions.json"), "w") as f:
        json.dump(results, f)


def image_f1(pred: dict[str, Tensor], truth: dict[str, Tensor], threshold: float = 0.5, iou: float = 0.5) -> float:
    """One image's F1 at IoU ``iou`` of its detections scored ``threshold`` or more (each true box matched once, by a
    box of its class, the best-scored first; crowd regions neither missed nor matched): how the worst images are
    found. 1 for an image with no objects and no detections."""
    from torchvision.ops import box_iou

    keep = pred["scores"] >= threshold
    boxes, labels = pred["boxes"][keep], pred["labels"][keep]
    crowd = truth.get("iscrowd", torch.zeros(len(truth["labels"]), dtype=torch.long)).bool()
    tboxes, tlabels = truth["boxes"][~crowd], truth["labels"][~crowd]
    if len(boxes) == 0 and len(tboxes) == 0:
        return 1.0
    matched, hits = torch.zeros(len(tboxes), dtype=torch.bool), 0
    overlaps = box_iou(boxes.float(), tboxes.float()) if len(boxes) and len(tboxes) else None
    for i in range(len(boxes)):  # already best-scored first
        if overlaps is None:
            break
        ok = (~matched) & (tlabels == labels[i]) & (overlaps[i] >= iou)
        if ok.any():
            j = int(torch.where(ok, overlaps[i], torch.full_like(overlaps[i], -1)).argmax())
            matched[j], hits = True, hits + 1
    return 2 * hits / (len(boxes) + len(tboxes))


def write_detection_report(result: dict, names: list[str], out: str | os.PathLike, mean, std,
                           extra: dict) -> dict:
    """``metrics.json`` (COCO's AP and AR, per-class AP), the split's ``truth.json`` and ``predictions.json`` (COCO's
    formats), ``pr_curve.png`` (precision against recall at IoU 0.5 and 0.75, over every class) and ``worst/`` (the
    images of lowest F1, their true boxes green and the detections above the threshold red)."""
    import numpy as np
    from PIL import Image, ImageDraw

    from .plots import pyplot

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metric = average_precision(class_metrics=True)
    metric.extended_summary = True
    metric.update(result["predictions"], result["truths"])
    computed = metric.compute()
    found = scores(computed, names)
    per_class = {k[3:]: v for k, v in found.items() if k.startswith("AP/")}
    metrics = {**extra, "samples": len(result["truths"]), "classes": len(names),
               **{k: v for k, v in found.items() if not k.startswith("AP/")}, "per_class_AP": per_class}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    coco_files(result["predictions"], result["truths"], result["sizes"], names, out)
    precision = computed.get("precision")  # (IoU thresholds, recall points, classes, areas, max detections)
    if precision is not None and precision.numel():
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 4))
        recall = np.linspace(0, 1, precision.shape[1])
        for t, iou in ((0, "0.50"), (5, "0.75")):
            p = precision[t, :, :, 0, -1].float()
            p = torch.where(p < 0, torch.nan, p).nanmean(dim=1).nan_to_num(0).numpy()
            ax.plot(recall, p, label=f"IoU {iou}")
        ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02), title="every class")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "pr_curve.png", dpi=100)
        plt.close(fig)
    (out / "worst").mkdir(exist_ok=True)
    m, s = np.asarray(mean).reshape(3, 1, 1), np.asarray(std).reshape(3, 1, 1)
    for rank, (f1, index, x, pred, truth, size) in enumerate(result["worst"]):
        image = Image.fromarray(((x.float().numpy() * s + m).clip(0, 1) * 255).astype(np.uint8).transpose(1, 2, 0))
        scale = x.shape[-1] / max(size)  # the letterboxed input over the image's own pixels
        draw = ImageDraw.Draw(image)
        for box, label in zip(truth["boxes"].tolist(), truth["labels"].tolist(), strict=True):
            draw.rectangle([v * scale for v in box], outline=(0, 200, 0))
            draw.text((box[0] * scale + 2, box[1] * scale + 1), names[label], fill=(0, 200, 0))
        keep = pred["scores"] >= 0.5
        for box, label, score in zip(pred["boxes"][keep].tolist(), pred["labels"][keep].tolist(),
                                     pred["scores"][keep].tolist(), strict=True):
            draw.rectangle([v * scale for v in box], outline=(220, 0, 0))
            draw.text((box[0] * scale + 2, box[3] * scale - 11), f"{names[label]} {score:.2f}", fill=(220, 0, 0))
        image.save(out / "worst" / f"{rank:02d}_image{index:05d}_f1{f1:.3f}.png")
    return metrics
