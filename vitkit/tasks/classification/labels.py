"""What a classifier's labels are, as one typed part of :class:`~vitkit.lit.ImageClassifier`: one class per image
(:class:`SingleLabel`: softmax, cross-entropy, top-1 and top-5) or several (:class:`MultiLabel`: a sigmoid per class,
BCE or ASL, mAP and F1 at thresholds chosen on the validation predictions). Each owns its targets (timm's Mixup and
CutMix, label smoothing), its loss, its metrics, what it keeps in the checkpoint and the probabilities it predicts;
the module holds their state (``metrics``, ``mixup``, and for several labels ``thresholds``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.mixup import mixup_target
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from vitkit.errors import UsageError, UsageTypeError
from vitkit.evaluation import multilabel as ml
from vitkit.evaluation.metrics import Predictions
from vitkit.training.parts import Part

from .multilabel import CHECKPOINT_KEY, MultiLabelLoss, ValidationPredictions, loss_of, pos_weight_of, soft_targets
from .multilabel import metrics as multilabel_metrics


class Labels(Part):
    """What the labels are: one class per image or several, with timm's Mixup and CutMix (``mixup``, ``cutmix``: their
    alphas, 0 disables each; ``mixup_prob``: the share of batches mixed; ``mixup_switch_prob``: the share of mixed
    batches that take CutMix when both are on) and ``label_smoothing``."""

    multi_label: ClassVar[bool]
    score: ClassVar[str]

    def __init__(self, label_smoothing: float = 0.1, mixup: float = 0.0, cutmix: float = 0.0, mixup_prob: float = 1.0,
                 mixup_switch_prob: float = 0.5) -> None:
        if type(self) is Labels:
            raise UsageTypeError("labels: choose SingleLabel or MultiLabel (Labels is what they share)")
        self.label_smoothing, self.mixup, self.cutmix = label_smoothing, mixup, cutmix
        self.mixup_prob, self.mixup_switch_prob = mixup_prob, mixup_switch_prob

    def timm_mixup(self, num_classes: int) -> Mixup | None:
        """timm's Mixup for these targets, or None where neither mixup nor cutmix is on."""
        if not (self.mixup > 0 or self.cutmix > 0):
            return None
        return Mixup(mixup_alpha=self.mixup, cutmix_alpha=self.cutmix, prob=self.mixup_prob,
                     switch_prob=self.mixup_switch_prob, label_smoothing=self.label_smoothing, num_classes=num_classes,
                     multi_label=self.multi_label)


class SingleLabel(Labels):
    """One class per image: a softmax over the classes.

    Soft-target cross-entropy, label-smoothed and mixed; validation by top-1 and top-5 (of the EMA too, where it is
    kept beside the model)."""

    multi_label: ClassVar[bool] = False
    score: ClassVar[str] = "val/top1"

    def attach(self, module) -> None:
        """The module's Mixup and metrics."""
        n = module.num_classes
        module.mixup = self.timm_mixup(n)
        module.metrics = nn.ModuleDict({
            f"{split}_{k}": MulticlassAccuracy(n, top_k=t, average="micro")
            for split in ("val", "val_ema", "test") for k, t in (("top1", 1), ("top5", min(5, n)))})

    def check_data(self, module, dm) -> None:
        if getattr(dm, "multi_label", False):
            raise UsageError(f"{dm.describe() if hasattr(dm, 'describe') else type(dm).__name__} gives several labels "
                             "per image (multi-hot targets); train with --model.labels MultiLabel")

    def train_loss(self, module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The label loss of a batch and the logits a teacher's term reads (DeiT's distillation head, or the one
        head). ``x`` is mixed in place."""
        soft = self.mix(module.mixup, x, y) if module.mixup is not None else None
        out = module(x)
        logits, distilled = out if isinstance(out, tuple) else (out, out)  # DeiT's two heads, or the one
        if soft is not None:
            loss = torch.sum(-soft * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        return loss, distilled

    @staticmethod
    def mix(mixup: Mixup, x: Tensor, y: Tensor) -> Tensor:
        """timm's Mixup/CutMix, which mixes a batch with its reverse and so takes even batches only. An odd batch
        (the last of an epoch, or one that lost an unreadable file) is mixed but for its last image, which keeps
        its own label-smoothed target."""
        n = len(x) - len(x) % 2
        soft = mixup_target(y, mixup.num_classes, smoothing=mixup.label_smoothing)
        if n:
            x[:n], soft[:n] = mixup(x[:n], y[:n])
        return soft

    def evaluate(self, module, x: Tensor, y: Tensor, split: str) -> Tensor:
        """The loss, top-1 and top-5 logged; the logits returned."""
        logits = module(x)
        module.log(f"{split}/loss", F.cross_entropy(logits.float(), y), prog_bar=split == "val", sync_dist=True,
                   batch_size=len(y))
        runs = [("", split, logits)] + ([("_ema", "val_ema", module.ema(x))] if module.ema_beside(split) else [])
        for suffix, key, out in runs:
            for k in ("top1", "top5"):
                module.metrics[f"{key}_{k}"](out, y)
                module.log(f"{split}/{k}{suffix}", module.metrics[f"{key}_{k}"], prog_bar=k == "top1" and not suffix,
                           batch_size=len(y))
        return logits

    def validation_end(self, module) -> None:
        pass

    def empty_predictions(self, num_classes: int) -> Predictions:
        return Predictions(torch.empty(0), torch.empty(0, dtype=torch.long), [])

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        pass

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        pass

    def probabilities(self, logits: Tensor) -> Tensor:
        return logits.softmax(dim=-1)


class MultiLabel(Labels):
    """Several labels per image (``multilabel.py``): a sigmoid per class.

    Multi-hot targets, smoothed towards 0.5 and mixed as the images are; ``loss`` ``bce`` (binary cross-entropy with
    logits, the mean over images and classes) or ``asl`` (the asymmetric loss, summed over classes); ``pos_weight``
    weighs each class's positives by its negatives / positives in the training set; ``thresholds`` (``per_class``:
    maximum F1 for each class, ``global``: one threshold of maximum micro F1, or ``fixed``: 0.5) says how the
    decision thresholds are chosen on the validation predictions after each validation (and kept in the checkpoint,
    exported models and ``vitkit predict``)."""

    multi_label: ClassVar[bool] = True
    score: ClassVar[str] = "val/mAP"

    def __init__(self, loss: MultiLabelLoss = "bce", pos_weight: bool = False,
                 thresholds: ml.ThresholdMode = "per_class", label_smoothing: float = 0.1, mixup: float = 0.0,
                 cutmix: float = 0.0, mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5) -> None:
        super().__init__(label_smoothing, mixup, cutmix, mixup_prob, mixup_switch_prob)
        self.loss, self.pos_weight, self.thresholds = loss, pos_weight, thresholds
        if self.loss not in ("bce", "asl"):
            raise UsageError(f"multi_label_loss must be 'bce' or 'asl', got {self.loss!r}")
        if self.thresholds not in ml.THRESHOLD_MODES:
            raise UsageError(f"thresholds must be one of {', '.join(ml.THRESHOLD_MODES)}, got {self.thresholds!r}")

    def attach(self, module) -> None:
        """The module's Mixup of multi-hot rows, its metrics, thresholds and the validation predictions they are
        chosen on."""
        n = module.num_classes
        module.mixup = self.timm_mixup(n)
        module.metrics = multilabel_metrics(n)
        module.register_buffer("thresholds", torch.full((n,), 0.5), persistent=False)
        module.pos_weight = None
        module._val_predictions = ValidationPredictions()

    def check_data(self, module, dm) -> None:
        if self.pos_weight:
            module.pos_weight = pos_weight_of(dm, module.num_classes).to(module.device)

    @staticmethod
    def multi_hot(y: Tensor, num_classes: int) -> Tensor:
        """Multi-hot rows (N, C), from class indices where the data gives one label per image."""
        return F.one_hot(y, num_classes).float() if y.ndim == 1 else y.float()

    def train_loss(self, module, x: Tensor, y: Tensor) -> tuple[Tensor, None]:
        n = module.num_classes
        target = soft_targets(module.mixup, x, self.multi_hot(y, n), n, self.label_smoothing)
        return loss_of(self.loss, module(x), target, module.pos_weight), None

    def evaluate(self, module, x: Tensor, y: Tensor, split: str) -> Tensor:
        """The BCE loss, mAP, micro AP and F1 at the current thresholds; the predictions kept for the thresholds."""
        y = self.multi_hot(y, module.num_classes)
        logits = module(x)
        n = len(y)
        module.log(f"{split}/loss", F.binary_cross_entropy_with_logits(logits.float(), y), prog_bar=split == "val",
                   sync_dist=True, batch_size=n)
        runs = [("", logits)] + ([("_ema", module.ema(x))] if module.ema_beside(split) else [])
        for suffix, out in runs:
            probs, key = out.float().sigmoid(), f"{split}{suffix}"
            for name, value in (("mAP", probs), ("mAP_micro", probs), ("f1", ml.decide(probs, module.thresholds))):
                module.metrics[f"{key}_{name}"](value, y.long())
                module.log(f"{split}/{name}{suffix}", module.metrics[f"{key}_{name}"],
                           prog_bar=name == "mAP" and not suffix, batch_size=n)
        if split == "val":
            module._val_predictions.add(logits, y)
        return logits

    def validation_end(self, module) -> None:
        """Every rank gathers the epoch's predictions and chooses the same thresholds."""
        probs, targets = module._val_predictions.gathered(module.trainer)
        if len(probs) and not module.trainer.sanity_checking:
            module.thresholds.copy_(ml.choose_thresholds(probs, targets, self.thresholds))

    def empty_predictions(self, num_classes: int):
        return ml.empty_predictions(num_classes)

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {"thresholds": module.thresholds.tolist(), "mode": self.thresholds}

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        if CHECKPOINT_KEY in checkpoint:
            module.thresholds.copy_(torch.tensor(checkpoint[CHECKPOINT_KEY]["thresholds"]))

    def probabilities(self, logits: Tensor) -> Tensor:
        return logits.sigmoid()
