"""What a classifier gets wrong, as pictures (matplotlib): the confusion matrix, the most confident mistakes and
the reliability diagram; for several labels per image, the precision-recall curves."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vitkit.evaluation.plots import pyplot

from .metrics import ECE_BINS, MATRIX_CLASSES


def confusion_picture(cm: Tensor, names: list[str], path: Path) -> Path:
    """The confusion matrix normalised by each true class; above MATRIX_CLASSES classes, the 20 most confused
    pairs as bars instead."""
    plt = pyplot()
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
    return image_grid([(img, f"label {names[y]}\npredicted {names[p]} ({conf:.2f})") for conf, img, y, p in mistakes],
                      path)


def image_grid(images: list[tuple[Tensor, str]], path: Path) -> Path:
    """Images in [0, 1] (C, H, W), four to a row, each with its title ("no mistakes" when there are none)."""
    plt = pyplot()
    n = max(len(images), 1)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    if not images:
        axes[0, 0].set_title("no mistakes")
    for ax, (img, title) in zip(axes.flat, images, strict=False):
        shown = img.permute(1, 2, 0).clamp(0, 1).numpy()
        ax.imshow(shown[..., 0] if shown.shape[-1] == 1 else shown, cmap="gray" if shown.shape[-1] == 1 else None)
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pr_curves_picture(probs: Tensor, targets: Tensor, names: list[str], result: dict, path: Path,
                      most: int = 20) -> Path:
    """Precision against recall of each class (up to ``most``: the weakest by AP), each labelled with its AP, and a
    dot where its threshold puts it; torchmetrics' curves."""
    from torchmetrics.functional.classification import multilabel_precision_recall_curve

    plt = pyplot()
    per = result["per_class"]
    shown = sorted(range(len(names)), key=lambda j: per[names[j]]["ap"])[:most]
    precision, recall, cuts = multilabel_precision_recall_curve(probs, targets.long(), num_labels=len(names))
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for j in shown:
        line, = ax.plot(recall[j].numpy(), precision[j].numpy(), label=f"{names[j]} (AP {per[names[j]]['ap']:.3f})")
        ax.plot([per[names[j]]["recall"]], [per[names[j]]["precision"]], "o", color=line.get_color())
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower left")
    weakest = f", the {len(shown)} weakest" if len(shown) < len(names) else ""
    ax.set_title(f"precision-recall by class{weakest} (dot: at its threshold); mAP {result['mAP']:.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reliability_picture(probs: Tensor, labels: Tensor, path: Path, bins: int = ECE_BINS) -> Path:
    """Accuracy against confidence in ``bins`` equal bins (the bins of the ECE), with the diagonal of a calibrated
    model and each bin's share of the images."""
    plt = pyplot()
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
