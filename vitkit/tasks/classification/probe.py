"""MAE's linear probe: a BatchNorm without affine parameters between a frozen backbone's pooled features and its
linear head, trained by SGD. The norm folds into the head in every checkpoint (an affine map at inference), so
the checkpoint is a plain classifier that ``create_model``, ``predict`` and ``export`` read; the unfolded head and
the norm's statistics travel beside it for a resumed run."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitkit.errors import UsageError

RAW = "head_norm.raw."  # the head as trained, beside the folded one, in a checkpoint's state dict


class HeadNorm(nn.Module):
    """``BatchNorm1d(features, affine=False, eps=1e-6)`` before the head of ``model`` (MAE's ``main_linprobe.py``
    protocol)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        head = model.get_classifier()
        if not isinstance(head, nn.Linear) or getattr(model, "head_dist", None) is not None:
            raise UsageError("--model.adaptation.head_norm takes a model with one linear head (a distilled model's two "
                             "heads or a headless model have none to put it before)")
        self.norm = nn.BatchNorm1d(head.in_features, affine=False, eps=1e-6)

    def forward(self, model: nn.Module, x: Tensor) -> Tensor:
        feats = model.forward_head(model.forward_features(x), pre_logits=True)
        return model.get_classifier()(self.norm(feats))

    def folded(self, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """The head's weight and bias with the norm's running statistics folded in:
        W (x - mean) / sd + b = (W / sd) x + (b - W mean / sd)."""
        sd = (self.norm.running_var + self.norm.eps).sqrt()
        w = weight / sd.to(weight.dtype)
        return w, bias - w @ self.norm.running_mean.to(weight.dtype)


def head_key(model: nn.Module) -> str:
    head = model.get_classifier()
    return next(name for name, m in model.named_modules() if m is head)


def fold_into_checkpoint(norm: HeadNorm, model: nn.Module, checkpoint: dict[str, Any]) -> None:
    sd, key = checkpoint["state_dict"], f"model.{head_key(model)}"
    w, b = sd[f"{key}.weight"], sd[f"{key}.bias"]
    sd[f"{RAW}weight"], sd[f"{RAW}bias"] = w, b
    sd[f"{key}.weight"], sd[f"{key}.bias"] = norm.folded(w, b)


def unfold_from_checkpoint(model: nn.Module, checkpoint: dict[str, Any]) -> None:
    sd = checkpoint["state_dict"]
    if f"{RAW}weight" in sd:
        key = f"model.{head_key(model)}"
        sd[f"{key}.weight"], sd[f"{key}.bias"] = sd.pop(f"{RAW}weight"), sd.pop(f"{RAW}bias")


@torch.no_grad()
def check_folding(norm: HeadNorm, model: nn.Module, x: Tensor) -> float:
    """The largest difference between the probe's eval logits and the folded head's (for tests)."""
    head = model.get_classifier()
    feats = model.forward_head(model.forward_features(x), pre_logits=True)
    w, b = norm.folded(head.weight, head.bias)
    return float((head(norm(feats)) - (feats @ w.T + b)).abs().max())
