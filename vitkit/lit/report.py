"""The report of ``vitkit train test``: every rank's test predictions gathered, written as ``vitkit evaluate``
writes them (``vitkit/tools/evaluate.py``) into ``<root>/evaluation``."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from vitkit.tools.evaluate import Predictions, scores, summary, write_report

from .hparams import gather_from_ranks


def display_stats(dm) -> tuple[Tensor, Tensor]:
    cfg = getattr(dm, "data_cfg", None)
    if cfg is None:
        return torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    return torch.tensor(cfg.mean).view(1, -1, 1, 1)[:, :3], torch.tensor(cfg.std).view(1, -1, 1, 1)[:, :3]


def collect(pred: Predictions, trainer: L.Trainer, batch: tuple[Tensor, Tensor], logits: Tensor,
            batch_idx: int) -> None:
    """One test batch's probabilities, labels and most confident mistakes, on this rank."""
    x, y = batch
    p = logits.float().softmax(-1).detach().cpu()
    pred.probs = torch.cat([pred.probs.view(-1, p.shape[1]), p])
    pred.labels = torch.cat([pred.labels, y.cpu()])
    pred.sources += [f"rank {trainer.global_rank} batch {batch_idx} row {i}" for i in range(len(y))]
    mean, std = display_stats(trainer.datamodule)
    pred.keep_mistakes((x.float().cpu() * std + mean).clamp(0, 1), p, y.cpu())


def write_test_report(module: L.LightningModule, pred: Predictions) -> dict[str, float]:
    """Every rank's test predictions together: the report of ``vitkit evaluate`` in ``<root>/evaluation`` (written
    by rank 0), and the scores to log beside top-1 and top-5 (every rank has them)."""
    trainer = module.trainer
    parts = gather_from_ranks(trainer, pred)
    if not any(len(p.labels) for p in parts):
        return {}
    merged = Predictions(torch.cat([p.probs for p in parts if len(p.labels)]), torch.cat([p.labels for p in parts]),
                         [s for p in parts for s in p.sources])
    merged.mistakes = sorted((m for p in parts for m in p.mistakes), key=lambda m: -m[0])[:len(pred.mistakes) or 16]
    names = list(getattr(module.hparams, "class_names", None) or []) or \
        list(getattr(module.model, "class_names", None) or []) or [str(i) for i in range(merged.probs.shape[1])]
    if trainer.is_global_zero:
        result = write_report(merged, names, Path(trainer.default_root_dir) / "evaluation")
        print(f"test report -> {Path(trainer.default_root_dir) / 'evaluation'}\n{summary(result)}")
    else:
        result = scores(merged.probs, merged.labels, names)
    return {"ece": result["ece"], "macro_f1": result["macro"]["f1"], "weighted_f1": result["weighted"]["f1"]}
