"""The linear probe, one solver for every task: a logistic regression on standardised features, L2 as
scikit-learn's ``LogisticRegression`` at C=1 (the penalty over the sample count, the bias not penalised), by L-BFGS
in float64. Its targets are one class per sample (softmax; two classes as scikit-learn's one binary row), each
class's share of the sample (softmax against soft targets: a segmentation patch's pixels), or several classes per
sample (a sigmoid per class). The fit is a :class:`Probe`: over standardised features, or folded into a linear head
over the raw ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from vitkit.errors import UsageError

MAX_ITER = 1000  # L-BFGS iterations; standardised features converge in far fewer
CONSTANT_LOGIT = 10.0  # a multi-label class always (or never) present in training: +10 (or -10), as it was seen


@dataclass
class Probe:
    """Logits ``((x - mean) / std) @ weight.T + bias``: weight (K, C), bias (K,), mean and std (C,)."""

    weight: Tensor
    bias: Tensor
    mean: Tensor
    std: Tensor

    def folded(self) -> tuple[Tensor, Tensor]:
        """(weight, bias) of the same logits over the raw features, in float32."""
        w = self.weight / self.std
        return w.float(), (self.bias - w @ self.mean).float()

    def logits(self, x: Tensor) -> Tensor:
        w, b = self.folded()
        return x.float() @ w.T + b


def standardised(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(z, mean, std) as scikit-learn's StandardScaler gives them, in float64."""
    x = x.double()
    mean, std = x.mean(0), x.std(0, correction=0).clamp_min(1e-6)
    return (x - mean) / std, mean, std


def _lbfgs(z: Tensor, loss_of, rows: int, bias: Tensor, max_iter: int) -> tuple[Tensor, Tensor]:
    """Minimise ``loss_of(logits) + 0.5 / n * |weight|^2`` over (weight (rows, C), bias (rows,))."""
    weight = torch.zeros(rows, z.shape[1], dtype=torch.float64, requires_grad=True)
    bias = bias.clone().double().requires_grad_(True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12, history_size=20)
    penalty = 0.5 / len(z)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = loss_of(z @ weight.T + bias) + penalty * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return weight.detach(), bias.detach()


def fit_logistic(x: Tensor, target: Tensor, multi_label: bool = False, max_iter: int = MAX_ITER) -> Probe:
    """The probe of features ``x`` (N, C) against ``target``: class indices (N,), class shares (N, K) whose rows sum
    to 1, or with ``multi_label`` multi-hot rows (N, K). A class no training sample holds gets the lowest logit (a
    softmax: below every training sample's logits), or a constant one (multi-label: -10 never present, +10
    always)."""
    if len(x) == 0:
        raise UsageError("the linear probe needs at least one training sample; none came")
    z, mean, std = standardised(x)
    if multi_label:
        y = target.double()
        present = y.mean(0)
        fit = (present > 0) & (present < 1)
        weight = torch.zeros(y.shape[1], x.shape[1], dtype=torch.float64)
        bias = torch.where(present >= 1, CONSTANT_LOGIT, -CONSTANT_LOGIT).double()
        if fit.any():
            n = int(fit.sum())
            loss = lambda logits: F.binary_cross_entropy_with_logits(logits, y[:, fit], reduction="sum") / len(z)
            weight[fit], bias[fit] = _lbfgs(z, loss, n, torch.zeros(n), max_iter)
        return Probe(weight, bias, mean, std)
    shares = target.double() if target.dim() == 2 else F.one_hot(target.long()).double()
    k = shares.shape[1]
    seen = shares.sum(0) > 0
    idx = seen.nonzero()[:, 0]
    s = shares[:, idx]
    if len(idx) == 2 and (s == s.round()).all():  # scikit-learn's binary case: one row, logits (-z/2, z/2)
        w1, b1 = _lbfgs(z, lambda logits: F.binary_cross_entropy_with_logits(logits[:, 0], s[:, 1]), 1,
                        torch.zeros(1), max_iter)
        w, b = torch.cat([-w1, w1]) / 2, torch.cat([-b1, b1]) / 2
    elif len(idx) == 1:
        w, b = torch.zeros(1, x.shape[1], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    else:
        start = torch.log(s.mean(0).clamp_min(1e-6))  # the class frequencies
        w, b = _lbfgs(z, lambda logits: -(s * F.log_softmax(logits, dim=1)).sum(1).mean(), len(idx), start,
                      max_iter)
    weight = torch.zeros(k, x.shape[1], dtype=torch.float64)  # an unseen class: below every training sample's
    bias = torch.full((k,), float((z @ w.T + b).min()) - CONSTANT_LOGIT, dtype=torch.float64)  # logits
    weight[idx], bias[idx] = w, b
    return Probe(weight, bias, mean, std)


def fit_linear_probe(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor,
                     num_classes: int) -> tuple[Tensor, Tensor, float]:
    """One label per image: the probe as a linear head over the raw features, (weight (num_classes, dim), bias
    (num_classes,), its top-1 on ``val``)."""
    target = F.one_hot(train_labels.long(), num_classes)
    weight, bias = fit_logistic(train, target).folded()
    top1 = float(((val.float() @ weight.T + bias).argmax(1) == val_labels).double().mean())
    return weight, bias, top1


def fit_multilabel_probe(train: Tensor, train_y: Tensor, val: Tensor, val_y: Tensor) -> tuple[Tensor, Tensor, float]:
    """Several labels per image (multi-hot (N, C)): the probe as a linear head over the raw features, (weight (C,
    dim), bias (C,), its macro mAP on ``val``)."""
    from torchmetrics.functional.classification import multilabel_average_precision

    weight, bias = fit_logistic(train, train_y, multi_label=True).folded()
    probs = (val.float() @ weight.T + bias).sigmoid()
    score = float(multilabel_average_precision(probs, val_y.long(), num_labels=train_y.shape[1], average="macro"))
    return weight, bias, score


def linear_probe_top1(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor) -> float:
    """A backbone's linear-probe top-1: the probe fitted on ``train``'s features, scored on ``val``'s."""
    classes = int(max(train_labels.max(), val_labels.max())) + 1
    return fit_linear_probe(train, train_labels, val, val_labels, classes)[2]
