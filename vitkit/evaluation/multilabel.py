"""Several labels per image: per-class thresholds chosen on held-out predictions, the scores (mAP, micro AP, F1,
per class AP / precision / recall / F1 / support; torchmetrics'), and the report ``vitkit evaluate`` writes for a
multi-label classifier: ``metrics.json``, ``predictions.csv``, ``pr_curves.png`` and ``mistakes.png``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from vitkit.checkpoints.files import write_json
from vitkit.errors import UsageError

from .metrics import MISTAKES, Predictions
from .pictures import image_grid, pr_curves_picture

ThresholdMode = Literal["per_class", "global", "fixed"]
THRESHOLD_MODES = ("per_class", "global", "fixed")


def _best_f1_cut(probs: Tensor, targets: Tensor) -> tuple[float, float]:
    """(threshold, F1) of the cut of ``probs`` (1-D) that maximises F1 against ``targets``: every image at or above
    the threshold is positive. The threshold lies halfway between the last positive and the next probability."""
    positives = float(targets.sum())
    if positives == 0:
        return 0.5, 0.0
    order = probs.argsort(descending=True)
    p, t = probs[order].double(), targets[order].double()
    tp = t.cumsum(0)
    k = torch.arange(1, len(p) + 1, dtype=torch.float64)
    f1 = 2 * tp / (k + positives)
    last = torch.ones(len(p), dtype=torch.bool)  # a cut falls only between different probabilities
    last[:-1] = p[:-1] != p[1:]
    f1 = torch.where(last, f1, torch.tensor(-1.0, dtype=torch.float64))
    i = int(f1.argmax())
    below = float(p[i + 1]) if i + 1 < len(p) else 0.0
    return (float(p[i]) + below) / 2, float(f1[i])


def choose_thresholds(probs: Tensor, targets: Tensor, mode: ThresholdMode = "per_class") -> Tensor:
    """Per-class decision thresholds (C,) from probabilities and multi-hot targets (N, C): ``per_class`` the one of
    maximum F1 for each class (0.5 for a class without a positive), ``global`` one threshold of maximum micro F1
    for every class, ``fixed`` 0.5."""
    if mode not in THRESHOLD_MODES:
        raise UsageError(f"thresholds must be one of {', '.join(THRESHOLD_MODES)}, got {mode!r}")
    c = probs.shape[1]
    if mode == "fixed" or len(probs) == 0:
        return torch.full((c,), 0.5)
    if mode == "global":
        return torch.full((c,), _best_f1_cut(probs.flatten().float(), targets.flatten().float())[0])
    return torch.tensor([_best_f1_cut(probs[:, j].float(), targets[:, j].float())[0] for j in range(c)])


def decide(probs: Tensor, thresholds: Tensor) -> Tensor:
    """Which labels are on (N, C), as integers: each probability at or above its class's threshold."""
    return (probs >= thresholds.to(probs.device, probs.dtype)).long()


def multilabel_scores(probs: Tensor, targets: Tensor, names: list[str], thresholds: Tensor) -> dict:
    """Every score of a multi-label ``metrics.json``, from torchmetrics: mAP (macro; a class without a positive
    counts 0, as in scikit-learn), micro AP, F1 / precision / recall at ``thresholds`` (macro and micro), and each
    class's AP, precision, recall, F1, support and threshold."""
    from torchmetrics.functional.classification import (
        multilabel_average_precision,
        multilabel_f1_score,
        multilabel_precision,
        multilabel_recall,
    )

    c = probs.shape[1]
    y, on = targets.long(), decide(probs, thresholds)
    kw = dict(num_labels=c)
    out = {"samples": len(y), "classes": c, "multi_label": True,
           "mAP": float(multilabel_average_precision(probs, y, average="macro", **kw)),
           "mAP_micro": float(multilabel_average_precision(probs, y, average="micro", **kw))}
    fns = (("precision", multilabel_precision), ("recall", multilabel_recall), ("f1", multilabel_f1_score))
    for avg in ("macro", "micro"):
        out[avg] = {name: float(f(on, y, average=avg, **kw)) for name, f in fns}
    per = {name: f(on, y, average="none", **kw) for name, f in fns}
    per["ap"] = multilabel_average_precision(probs, y, average="none", **kw)
    support = y.sum(0)
    out["per_class"] = {names[j]: {**{k: float(v[j]) for k, v in per.items()}, "support": int(support[j]),
                                   "threshold": float(thresholds[j])} for j in range(c)}
    out["thresholds"] = [float(t) for t in thresholds]
    return out


def keep_mistakes(pred: Predictions, images: Tensor, probs: Tensor, targets: Tensor, thresholds: Tensor,
                  names: list[str], k: int = MISTAKES) -> None:
    """Keep the ``k`` images whose worst label decision is the most confident wrong one (a label on with a high
    probability that the image lacks, or one it has with a low probability), titled by their true and predicted
    labels."""
    on = decide(probs, thresholds)
    wrongness = torch.where(targets.bool(), 1 - probs, probs)  # how sure the model was of the wrong answer
    wrongness = torch.where(on.bool() != targets.bool(), wrongness, torch.zeros_like(wrongness))
    worst = wrongness.max(1).values
    for i in (worst > 0).nonzero().flatten().tolist():
        pred.mistakes.append((float(worst[i]), images[i].float().cpu(), label_text(targets[i], names),
                              label_text(on[i], names)))
    pred.mistakes = sorted(pred.mistakes, key=lambda m: -m[0])[:k]


def label_text(row: Tensor, names: list[str]) -> str:
    """The names of a multi-hot row's labels, space-separated ("-" for none)."""
    return " ".join(names[j] for j in row.nonzero().flatten().tolist()) or "-"


def write_multilabel_report(pred: Predictions, names: list[str], thresholds: Tensor, out: str | Path,
                            extra: dict | None = None) -> dict:
    """``metrics.json``, ``predictions.csv`` (the source, the true labels, the labels predicted at the thresholds,
    then one probability column per class, named by the class), ``pr_curves.png`` and ``mistakes.png`` into
    ``out``; returns the scores."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**multilabel_scores(pred.probs, pred.labels, names, thresholds), **(extra or {})}
    write_json(result, out / "metrics.json")
    on = decide(pred.probs, thresholds)
    with open(out / "predictions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "labels", "predicted", *names])
        for src, y, o, p in zip(pred.sources, pred.labels, on, pred.probs.tolist(), strict=True):
            w.writerow([src, label_text(y, names), label_text(o, names), *[f"{q:.6f}" for q in p]])
    pr_curves_picture(pred.probs, pred.labels, names, result, out / "pr_curves.png")
    image_grid([(img, f"labels {y}\npredicted {p} ({conf:.2f})") for conf, img, y, p in pred.mistakes],
               out / "mistakes.png")
    return result


def multilabel_summary(result: dict) -> str:
    """The overall scores and the five weakest classes by AP."""
    lines = [f"mAP {result['mAP']:.4f}  micro AP {result['mAP_micro']:.4f}  macro F1 {result['macro']['f1']:.4f}  "
             f"micro F1 {result['micro']['f1']:.4f}  ({result['samples']} images, {result['classes']} classes)"]
    weak = sorted(result["per_class"].items(), key=lambda kv: kv[1]["ap"])[:5]
    lines.append("weakest classes (AP): " + ", ".join(f"{k} {v['ap']:.3f}" for k, v in weak))
    return "\n".join(lines)


def empty_predictions(num_classes: int) -> Predictions:
    return Predictions(torch.empty(0, num_classes), torch.empty(0, num_classes), [])
