"""The report of ``vitkit train test`` for :class:`~vitkit.lit.ImageClassifier`: every rank's test predictions
(probabilities, labels, the most confident mistakes), gathered and written as ``vitkit evaluate`` writes them."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from vitkit.distributed import gather_from_ranks
from vitkit.evaluation import multilabel as ml
from vitkit.evaluation.metrics import Predictions, scores, summary
from vitkit.evaluation.report import display_stats, write_report

from .labels import MultiLabel


def collect(pred: Predictions, trainer: L.Trainer, batch: tuple[Tensor, Tensor], logits: Tensor,
            batch_idx: int) -> None:
    """One test batch's probabilities, labels and most confident mistakes, on this rank."""
    x, y = batch
    module = trainer.lightning_module
    multi = getattr(module, "multi_label", False)
    p = (logits.float().sigmoid() if multi else logits.float().softmax(-1)).detach().cpu()
    y = MultiLabel.multi_hot(y, p.shape[1]).cpu() if multi else y.cpu()
    pred.probs = torch.cat([pred.probs.view(-1, p.shape[1]), p])
    pred.labels = torch.cat([pred.labels, y])
    pred.sources += [f"rank {trainer.global_rank} batch {batch_idx} row {i}" for i in range(len(y))]
    mean, std = display_stats(trainer.datamodule)
    images = (x.float().cpu() * std + mean).clamp(0, 1)
    if multi:
        ml.keep_mistakes(pred, images, p, y, module.thresholds.cpu(), _names(module, p.shape[1]))
    else:
        pred.keep_mistakes(images, p, y)


def _names(module: L.LightningModule, classes: int) -> list[str]:
    return list(getattr(module.hparams, "class_names", None) or []) or \
        list(getattr(module.model, "class_names", None) or []) or [str(i) for i in range(classes)]


def write_test_report(module: L.LightningModule, pred: Predictions) -> dict[str, float]:
    """Every rank's test predictions together: the report of ``vitkit evaluate`` in ``<root>/evaluation`` (written
    by rank 0), and the scores to log beside top-1 and top-5, or mAP (every rank has them)."""
    trainer = module.trainer
    parts = gather_from_ranks(trainer, pred)
    if not any(len(p.labels) for p in parts):
        return {}
    merged = Predictions(torch.cat([p.probs for p in parts if len(p.labels)]),
                         torch.cat([p.labels for p in parts if len(p.labels)]), [s for p in parts for s in p.sources])
    merged.mistakes = sorted((m for p in parts for m in p.mistakes), key=lambda m: -m[0])[:len(pred.mistakes) or 16]
    names = _names(module, merged.probs.shape[1])
    multi = getattr(module, "multi_label", False)
    out = Path(trainer.default_root_dir) / "evaluation"
    if multi:
        thresholds = module.thresholds.cpu()
        result = ml.write_multilabel_report(merged, names, thresholds, out) if trainer.is_global_zero else \
            ml.multilabel_scores(merged.probs, merged.labels, names, thresholds)
        text = ml.multilabel_summary(result)
    else:
        result = write_report(merged, names, out) if trainer.is_global_zero else \
            scores(merged.probs, merged.labels, names)
        text = summary(result)
    if trainer.is_global_zero:
        print(f"test report -> {out}\n{text}")
    if multi:
        return {"micro_f1": result["micro"]["f1"], "macro_f1": result["macro"]["f1"]}
    return {"ece": result["ece"], "macro_f1": result["macro"]["f1"], "weighted_f1": result["weighted"]["f1"]}
