"""The folder ``vitkit evaluate`` writes (and ``vitkit train test`` into ``<root>/evaluation``): ``metrics.json``,
``predictions.csv`` and the pictures; for a backbone, its k-NN and probe scores. :func:`display_stats`: how a data
module's normalised images are shown."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch
from torch import Tensor

from vitkit.checkpoints.files import write_json

from .metrics import Predictions, scores
from .pictures import confusion_picture, mistakes_picture, reliability_picture


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



def write_backbone_report(result: dict, out: str | Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "metrics.json")
    return json.loads((out / "metrics.json").read_text())


def display_stats(dm) -> tuple[Tensor, Tensor]:
    cfg = getattr(dm, "data_cfg", None)
    if cfg is None:
        return torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    return torch.tensor(cfg.mean).view(1, -1, 1, 1)[:, :3], torch.tensor(cfg.std).view(1, -1, 1, 1)[:, :3]
