"""What a classifier gets wrong: top-k, per-class precision / recall / F1, calibration, a confusion matrix, the most
confident mistakes; and for a backbone, DINO's k-NN vote and a logistic-regression probe on its pooled features.

The scores are torchmetrics', the probe scikit-learn's and the pictures matplotlib's; this module gathers the
predictions, writes ``metrics.json``, ``predictions.csv`` and the pictures, and prints a summary. ``vitkit
evaluate`` runs it over any data module; ``vitkit train test`` writes the same into the run's folder.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from vitkit.checkpoints.files import write_json

from .plots import _plt

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


def linear_probe_top1(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor) -> float:
    """scikit-learn's logistic regression on standardised features (the L-BFGS solver, L2 at C=1)."""
    return _linear_probe(train, train_labels).score(val.float().numpy(), val_labels.numpy())


def _linear_probe(train: Tensor, train_labels: Tensor):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    return probe.fit(train.float().numpy(), train_labels.numpy())


def fit_linear_probe(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor,
                     num_classes: int) -> tuple[Tensor, Tensor, float]:
    """The probe of :func:`linear_probe_top1` as a linear head over the raw features, the standardisation folded
    in: (weight (num_classes, dim), bias (num_classes,), its top-1 on ``val``). A class without training samples
    gets the lowest logit."""
    probe = _linear_probe(train, train_labels)
    scaler, lr = probe[0], probe[1]
    coef, icpt = torch.as_tensor(lr.coef_, dtype=torch.float64), torch.as_tensor(lr.intercept_, dtype=torch.float64)
    if len(lr.classes_) == 2:  # one row for class 1 against class 0: logits (0, z) rank as (-z/2, z/2)
        coef, icpt = torch.cat([-coef, coef]) / 2, torch.cat([-icpt, icpt]) / 2
    w = coef / torch.as_tensor(scaler.scale_, dtype=torch.float64)
    b = icpt - w @ torch.as_tensor(scaler.mean_, dtype=torch.float64)
    weight = torch.zeros(num_classes, train.shape[1], dtype=torch.float64)
    bias = torch.full((num_classes,), float(b.min()) - 10, dtype=torch.float64)
    idx = torch.as_tensor(lr.classes_, dtype=torch.long)
    weight[idx], bias[idx] = w, b
    return weight.float(), bias.float(), float(probe.score(val.float().numpy(), val_labels.numpy()))


# -- the folder of results --------------------------------------------------------------------------------------


def write_report(pred: Predictions, names: list[str], out: str | Path, topk: int = 5,
                 extra: dict | None = None) -> dict:
    """``metrics.json``, ``predictions.csv``, ``confusion_matrix.png``, ``mistakes.png`` and ``reliability.png``
    into ``out``; returns the scores."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**scores(pred.probs, pred.labels, names), **(extra or {})}
    write_json(result, out / "metrics.json")
    k = min(topk, len(names))
    top = pred.probs.topk(k, dim=1)
    with open(out / "predictions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "label", *[h for i in range(1, k + 1) for h in (f"top{i}", f"p{i}")]])
        for src, y, idx, p in zip(pred.sources, pred.labels.tolist(), top.indices.tolist(), top.values.tolist(),
                                  strict=True):
            w.writerow([src, names[y], *[v for i, q in zip(idx, p, strict=True) for v in (names[i], f"{q:.4f}")]])
    confusion_picture(torch.tensor(result["confusion_matrix"]), names, out / "confusion_matrix.png")
    mistakes_picture(pred.mistakes, names, out / "mistakes.png")
    reliability_picture(pred.probs, pred.labels, out / "reliability.png")
    return result


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


def confusion_picture(cm: Tensor, names: list[str], path: Path) -> Path:
    """The confusion matrix normalised by each true class; above MATRIX_CLASSES classes, the 20 most confused
    pairs as bars instead."""
    plt = _plt()
    c = len(names)
    if c <= MATRIX_CLASSES:
        norm = cm.float() / cm.sum(1, keepdim=True).clamp_min(1)
        size = max(4.0, 0.28 * c + 2)
        fig, ax = plt.subplots(figsize=(size + 1, size))
        im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(c), names, rotation=90, fontsize=max(5, 10 - c // 8))
        ax.set_yticks(range(c), names, fontsize=max(5, 10 - c // 8))
        if c <= 15:
            for i in range(c):
                for j in range(c):
                    if norm[i, j] >= 0.005:
                        ax.text(j, i, f"{norm[i, j]:.2f}", ha="center", va="center", fontsize=7,
                                color="white" if norm[i, j] > 0.5 else "black")
        ax.set_xlabel("predicted")
        ax.set_ylabel("label")
        fig.colorbar(im, ax=ax, fraction=0.046)
        ax.set_title("confusion matrix (each row: one label, sums to 1)")
    else:
        off = cm.clone().fill_diagonal_(0)
        flat = off.flatten().topk(min(20, off.numel()))
        pairs = [(int(n), *divmod(int(i), c)) for n, i in zip(flat.values, flat.indices, strict=True) if n > 0]
        fig, ax = plt.subplots(figsize=(8, 0.35 * max(len(pairs), 1) + 1.5))
        ax.barh(range(len(pairs)), [n for n, _, _ in pairs], color="tab:red")
        ax.set_yticks(range(len(pairs)), [f"{names[i]} -> {names[j]}" for _, i, j in pairs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("images")
        ax.set_title(f"the most confused pairs of {c} classes (label -> predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mistakes_picture(mistakes: list[tuple[float, Tensor, int, int]], names: list[str], path: Path) -> Path:
    """The most confident wrong predictions, each titled with its label and prediction."""
    plt = _plt()
    n = max(len(mistakes), 1)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    if not mistakes:
        axes[0, 0].set_title("no mistakes")
    for ax, (conf, img, y, p) in zip(axes.flat, mistakes, strict=False):
        shown = img.permute(1, 2, 0).clamp(0, 1).numpy()
        ax.imshow(shown[..., 0] if shown.shape[-1] == 1 else shown, cmap="gray" if shown.shape[-1] == 1 else None)
        ax.set_title(f"label {names[y]}\npredicted {names[p]} ({conf:.2f})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reliability_picture(probs: Tensor, labels: Tensor, path: Path, bins: int = ECE_BINS) -> Path:
    """Accuracy against confidence in ``bins`` equal bins (the bins of the ECE), with the diagonal of a calibrated
    model and each bin's share of the images."""
    plt = _plt()
    conf, pred = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1)
    which = torch.bucketize(conf, edges[1:-1], right=True)
    acc = [float((pred[which == b] == labels[which == b]).float().mean()) if (which == b).any() else 0.0
           for b in range(bins)]
    share = [float((which == b).float().mean()) for b in range(bins)]
    fig, ax = plt.subplots(figsize=(5, 5))
    centres = ((edges[:-1] + edges[1:]) / 2).numpy()
    ax.bar(centres, acc, width=1 / bins, edgecolor="black", color="tab:blue", label="accuracy")
    ax.bar(centres, share, width=1 / bins * 0.4, color="tab:orange", alpha=0.7, label="share of images")
    ax.plot([0, 1], [0, 1], "k--", label="calibrated")
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    ax.set_title("reliability")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_backbone_report(result: dict, out: str | Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "metrics.json")
    return json.loads((out / "metrics.json").read_text())
