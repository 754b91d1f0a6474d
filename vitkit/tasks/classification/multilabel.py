"""Several labels per image for :class:`~vitkit.lit.ImageClassifier` (``multi_label=True``): multi-hot targets
(mixed by timm's Mixup, smoothed towards 0.5 as timm smooths dense targets), BCE with logits or the asymmetric loss
(Ridnik et al., 2021, timm's ``AsymmetricLossMultiLabel``), ``pos_weight`` from the training set's label
frequencies, and the per-class thresholds chosen on the validation predictions at the end of each validation
(``vitkit/evaluation/multilabel.py``), which the checkpoint carries."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from timm.data.mixup import mixup_target
from timm.loss import AsymmetricLossMultiLabel
from torch import Tensor, nn
from torchmetrics.classification import MultilabelAveragePrecision, MultilabelF1Score

from vitkit.distributed import gather_from_ranks
from vitkit.errors import UsageError

MultiLabelLoss = Literal["bce", "asl"]
CHECKPOINT_KEY = "multi_label"  # {"thresholds": [...], "threshold_mode": ...} beside the state dict


def soft_targets(mixup, x: Tensor, y: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """The batch's multi-hot targets, smoothed towards 0.5 and, with ``mixup`` (timm's, ``multi_label=True``), mixed
    as the images are (in place). An odd batch is mixed but for its last image."""
    soft = mixup_target(y.float(), num_classes, smoothing=smoothing, multi_label=True)
    n = len(y) - len(y) % 2
    if mixup is not None and n:
        x[:n], soft[:n] = mixup(x[:n], y[:n].float())
    return soft


def loss_of(kind: MultiLabelLoss, logits: Tensor, target: Tensor, pos_weight: Tensor | None) -> Tensor:
    """BCE with logits averaged over images and classes, or ASL summed over classes and averaged over images."""
    if kind == "asl":
        return AsymmetricLossMultiLabel(pos_weight=pos_weight, reduction="batchmean")(logits, target)
    return F.binary_cross_entropy_with_logits(logits.float(), target.float(), pos_weight=pos_weight)


def pos_weight_of(dm: L.LightningDataModule | None, num_classes: int) -> Tensor:
    """Each class's negatives over its positives in the training set (a class without a positive counts one), from
    the data module's ``label_counts()``."""
    if dm is None or not hasattr(dm, "label_counts"):
        raise UsageError(f"pos_weight needs the training set's label counts, which {type(dm).__name__} does not give; "
                         "use a ManifestDataModule or an HFDataModule, or leave pos_weight off")
    counts, n = dm.label_counts()
    if len(counts) != num_classes:
        raise UsageError(f"the data counts {len(counts)} classes, the model has {num_classes}")
    weight = (n - counts) / counts.clamp_min(1)
    rank_zero_info(f"pos_weight: negatives / positives per class, from {n} training images "
                   f"(from {float(weight.min()):.2f} to {float(weight.max()):.2f})")
    return weight.float()


def metrics(num_classes: int) -> nn.ModuleDict:
    """torchmetrics' mAP (macro), micro AP and macro F1 (of labels decided at the thresholds) for each split."""
    return nn.ModuleDict({f"{split}_{k}": m for split in ("val", "val_ema", "test") for k, m in (
        ("mAP", MultilabelAveragePrecision(num_classes, average="macro")),
        ("mAP_micro", MultilabelAveragePrecision(num_classes, average="micro")),
        ("f1", MultilabelF1Score(num_classes, average="macro")))})


class ValidationPredictions:
    """The validation epoch's probabilities and targets on this rank, gathered across ranks at its end."""

    def __init__(self) -> None:
        self.probs: list[Tensor] = []
        self.targets: list[Tensor] = []

    def add(self, logits: Tensor, y: Tensor) -> None:
        self.probs.append(logits.detach().float().sigmoid().cpu())
        self.targets.append(y.detach().cpu())

    def gathered(self, trainer: L.Trainer) -> tuple[Tensor, Tensor]:
        """Every rank's predictions of the epoch (a collective: every rank calls it), and a fresh start."""
        local = (torch.cat(self.probs), torch.cat(self.targets)) if self.probs else (torch.empty(0), torch.empty(0))
        self.probs, self.targets = [], []
        parts = [p for p in gather_from_ranks(trainer, local) if len(p[0])]
        if not parts:
            return torch.empty(0), torch.empty(0)
        return torch.cat([p for p, _ in parts]), torch.cat([t for _, t in parts])
