"""Evaluation: what a classifier gets wrong and how good a backbone's features are.

- :mod:`~vitkit.evaluation.metrics`: the scores (top-k, per-class precision / recall / F1, ECE, confusion, the most
  confident mistakes; a backbone's k-NN and linear probe);
- :mod:`~vitkit.evaluation.pictures`: the confusion matrix, mistakes and reliability diagram as pictures;
- :mod:`~vitkit.evaluation.report`: the folder of results (``metrics.json``, ``predictions.csv``, the pictures), and
  the report of ``vitkit train test`` gathered from every rank;
- :mod:`~vitkit.evaluation.predict`: a model over a split of a data module.

The command that loads a model and data and runs these is ``vitkit evaluate`` (``vitkit/cli/evaluate.py``).
"""

from .metrics import Predictions, knn_top1, scores, summary
from .probe import fit_linear_probe, linear_probe_top1
from .report import write_backbone_report, write_report

__all__ = ["Predictions", "fit_linear_probe", "knn_top1", "linear_probe_top1", "scores", "summary",
           "write_backbone_report", "write_report"]
