"""A model over a split of a data module: softmax predictions with their sources, or pooled features, and a
backbone's k-NN and probe scores on them."""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from vitkit.errors import UsageError
from vitkit.models.packing import PackedBatch

from . import multilabel as ml
from .metrics import Predictions, knn_top1
from .probe import linear_probe_top1
from .report import display_stats


def batches(dm, ds, device: torch.device):
    """(x on the device, y, the rows' sources) of each batch that has an image; unreadable images are skipped."""
    from rich.progress import track

    loader = dm.loader(ds, False)
    samples = getattr(ds, "samples", None)
    seen = 0
    for batch in track(loader, description="evaluating", transient=True, disable=not sys.stderr.isatty()):
        skipped = int(batch[2]) if len(batch) == 3 else 0
        x, y = dm.on_after_batch_transfer(batch, 0)[:2]
        rows = list(range(seen, seen + len(y) + skipped))
        seen += len(y) + skipped
        if len(y) == 0:
            continue
        if skipped:  # which rows were dropped is not known here: name the batch's rows
            sources = [f"rows {rows[0]}-{rows[-1]}"] * len(y)
        elif samples is not None:  # a file path (or a dataset's row name)
            sources = [str(samples[i][0]) for i in rows]
        else:
            sources = [str(i) for i in rows]
        yield x.to(device), y, sources


def width(model, dm, ds, device: torch.device) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        return cfg.num_classes
    x, _, _ = next(batches(dm, ds, device))
    with torch.no_grad():
        return model(x[:1]).shape[-1]


@torch.no_grad()
def predict(model, dm, ds, device: torch.device, thresholds: Tensor | None = None,
            names: list[str] | None = None) -> Predictions:
    """Softmax probabilities, labels and sources of every readable image of ``ds``; the most confident mistakes.
    With a multi-label model's ``thresholds`` (and its class ``names``): a sigmoid per class, and multi-hot labels
    (class indices become one-hot rows)."""
    mean, std = display_stats(dm)
    probs, labels, sources = [], [], []
    pred = Predictions(torch.empty(0), torch.empty(0, dtype=torch.long), [])
    for x, y, src in batches(dm, ds, device):
        logits = model(x).float().cpu()
        images = [(im.float().cpu() * std[0] + mean[0]).clamp(0, 1) for im in x.images()] \
            if isinstance(x, PackedBatch) else (x.float().cpu() * std + mean).clamp(0, 1)
        if thresholds is None:
            p, y = logits.softmax(-1), y.cpu()
            pred.keep_mistakes(images, p, y)
        else:
            p = logits.sigmoid()
            y = torch.nn.functional.one_hot(y.cpu(), p.shape[1]).float() if y.ndim == 1 else y.float().cpu()
            ml.keep_mistakes(pred, images, p, y, thresholds, names)
        probs.append(p)
        labels.append(y)
        sources += src
    pred.probs, pred.labels, pred.sources = torch.cat(probs), torch.cat(labels), sources
    return pred


@torch.no_grad()
def pooled_features(net: torch.nn.Module, batches, device: torch.device) -> tuple[Tensor, Tensor]:
    """A timm-style network's pooled features before its head (``forward_head(..., pre_logits=True)``), in eval
    mode, and the labels, over ``batches`` of (images, labels); a batch with no readable image (None or empty) is
    passed over. The network's mode is restored."""
    feats, labels = [], []
    was_training = net.training
    net.eval()
    for x, y in batches:
        if x is not None and len(y):
            f = net.forward_packed(x.to(device), pre_logits=True) if isinstance(x, PackedBatch) else \
                net.forward_head(net.forward_features(x.to(device)), pre_logits=True)
            feats.append(f.float().cpu())
            labels.append(y.cpu())
    net.train(was_training)
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def features(model, dm, ds, device: torch.device) -> tuple[Tensor, Tensor]:
    feats, labels = [], []
    for x, y, _ in batches(dm, ds, device):
        feats.append(model.features(x).float().cpu())
        labels.append(y.cpu())
    return torch.cat(feats), torch.cat(labels)


def backbone_scores(model, dm, ds, device: torch.device, knn: bool, linear_probe: bool, k: int = 20,
                    temperature: float = 0.07) -> dict:
    """k-NN (DINO's vote) and logistic-regression top-1 of ``model.features`` over ``ds``, fitted on the data
    module's train split."""
    if not hasattr(model, "features"):
        raise UsageError("--knn and --linear-probe need a PyTorch model (--checkpoint or --model), not --onnx")
    train, train_y = features(model, dm, dm.train_set, device)
    val, val_y = features(model, dm, ds, device)
    result: dict = {"train_samples": len(train_y), "samples": len(val_y), "feature_dim": train.shape[1]}
    if knn:
        result["knn_top1"] = knn_top1(train, train_y, val, val_y, k, temperature)
        result.update(k=k, temperature=temperature)
    if linear_probe:
        result["linear_probe_top1"] = linear_probe_top1(train, train_y, val, val_y)
    return result

