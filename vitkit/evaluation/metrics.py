"""What a classifier gets wrong, as numbers: top-k, per-class precision / recall / F1, calibration (ECE), the
confusion matrix and its most confused pairs, the most confident mistakes; and for a backbone, DINO's k-NN vote and
a logistic-regression probe on its pooled features. The scores are torchmetrics', the probe scikit-learn's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

MATRIX_CLASSES = 50  # up to this many classes a confusion matrix is readable; above, the most confused pairs
MISTAKES = 16
ECE_BINS = 15


@dataclass
class Predictions:
    """Probabilities and labels of a split, where each sample came from, and the most confident mistakes (images
    in [0, 1])."""

    probs: Tensor
    labels: Tensor
    sources: list[str]
    mistakes: list[tuple[float, Tensor, int, int]] = field(default_factory=list)

    def keep_mistakes(self, images: Tensor, probs: Tensor, labels: Tensor, k: int = MISTAKES) -> None:
        conf, pred = probs.max(-1)
        wrong = (pred != labels).nonzero().flatten().tolist()
        self.mistakes += [(float(conf[i]), images[i].float().cpu(), int(labels[i]), int(pred[i])) for i in wrong]
        self.mistakes = sorted(self.mistakes, key=lambda m: -m[0])[:k]


def scores(probs: Tensor, labels: Tensor, names: list[str]) -> dict:
    """Every score of ``metrics.json``, from torchmetrics."""
    from torchmetrics.functional.classification import (
        multiclass_accuracy,
        multiclass_calibration_error,
        multiclass_confusion_matrix,
        multiclass_f1_score,
        multiclass_precision,
        multiclass_recall,
    )

    c = probs.shape[1]
    kw = dict(num_classes=c)
    out = {"samples": len(labels), "classes": c,
           "top1": float(multiclass_accuracy(probs, labels, top_k=1, average="micro", **kw)),
           "top5": float(multiclass_accuracy(probs, labels, top_k=min(5, c), average="micro", **kw)),
           "ece": float(multiclass_calibration_error(probs, labels, n_bins=ECE_BINS, norm="l1", **kw))}
    per = {name: f(probs, labels, average="none", **kw) for name, f in
           (("precision", multiclass_precision), ("recall", multiclass_recall), ("f1", multiclass_f1_score))}
    support = torch.bincount(labels, minlength=c)
    for avg in ("macro", "weighted"):
        out[avg] = {name: float(f(probs, labels, average=avg, **kw)) for name, f in
                    (("precision", multiclass_precision), ("recall", multiclass_recall), ("f1", multiclass_f1_score))}
    out["per_class"] = {names[i]: {**{k: float(v[i]) for k, v in per.items()}, "support": int(support[i])}
                        for i in range(c)}
    cm = multiclass_confusion_matrix(probs, labels, **kw)
    out["confusion_matrix"] = cm.tolist()
    off = cm.clone().fill_diagonal_(0)
    pairs = [(int(off[i, j]), i, j) for i, j in off.nonzero().tolist()]
    out["confused_pairs"] = [{"label": names[i], "predicted": names[j], "count": n}
                             for n, i, j in sorted(pairs, key=lambda p: -p[0])[:20]]
    return out


def knn_top1(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor, k: int = 20,
             temperature: float = 0.07, chunk: int = 1024) -> float:
    """DINO's weighted k-NN vote on L2-normalised features: each of the ``k`` nearest training samples votes for
    its class with weight exp(cosine / temperature)."""
    train, val = F.normalize(train.float(), dim=1), F.normalize(val.float(), dim=1)
    c = int(max(train_labels.max(), val_labels.max())) + 1
    k = min(k, len(train))
    correct = 0
    for s in range(0, len(val), chunk):
        sim, idx = (val[s:s + chunk] @ train.T).topk(k, dim=1)
        votes = torch.zeros(len(sim), c).scatter_add_(1, train_labels[idx], (sim / temperature).exp())
        correct += int((votes.argmax(1) == val_labels[s:s + chunk]).sum())
    return correct / len(val)


def summary(result: dict) -> str:
    """The overall scores, the five weakest classes (by F1) and the five most confused pairs."""
    lines = [f"top-1 {result['top1']:.4f}  top-5 {result['top5']:.4f}  macro F1 {result['macro']['f1']:.4f}  "
             f"ECE {result['ece']:.4f}  ({result['samples']} images, {result['classes']} classes)"]
    weak = sorted(result["per_class"].items(), key=lambda kv: kv[1]["f1"])[:5]
    lines.append("weakest classes (F1): " + ", ".join(f"{k} {v['f1']:.3f}" for k, v in weak))
    pairs = result["confused_pairs"][:5]
    lines.append("most confused (label -> predicted, count): " + (", ".join(
        f"{p['label']} -> {p['predicted']} {p['count']}" for p in pairs) or "none"))
    return "\n".join(lines)
