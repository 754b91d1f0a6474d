"""Depth as the field scores and trains it, on valid pixels only (a depth of 0, NaN or inf is no measurement).

* :func:`depth_errors`: Eigen et al.'s (2014) errors of one image, AbsRel, SqRel, RMSE, RMSE log, log10 and the
  shares within 1.25, 1.25² and 1.25³ (δ1..δ3); :class:`DepthMetrics` averages them over images (each image weighs
  one, as Depth Anything's and ZoeDepth's evaluations do) and over ranks.
* :func:`aligned`: a relative model's output (affine-invariant inverse depth, MiDaS's and Depth Anything's) brought to
  the truth's depth before it is scored: the scale and shift of least squares in inverse depth (MiDaS's evaluation),
  or the median ratio in depth (Eigen's ``median`` scaling).
* :func:`eigen_crop`: KITTI's crop of Garg et al. (2016), the pixels Eigen's split scores.
* Losses: :func:`ssi_loss` (affine-invariant, median and mean absolute deviation, with MiDaS's multi-scale gradient
  matching) for relative depth,
  :func:`silog_loss` (the scale-invariant log loss, Eigen's, with Depth Anything's and BTS's λ) for metric depth.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

NAMES = ("AbsRel", "SqRel", "RMSE", "RMSE_log", "log10", "delta1", "delta2", "delta3")
LOWER_IS_BETTER = {"AbsRel", "SqRel", "RMSE", "RMSE_log", "log10"}


def valid_mask(target: Tensor, min_depth: float = 1e-3, max_depth: float | None = None) -> Tensor:
    """The pixels with a measurement: finite, above ``min_depth`` and, where given, at most ``max_depth``."""
    ok = torch.isfinite(target) & (target > min_depth)
    return ok if max_depth is None else ok & (target <= max_depth)


def eigen_crop(height: int, width: int, device=None) -> Tensor:
    """(H, W) bool: Garg's crop of a KITTI image, rows 40.8 % to 99.2 % and columns 3.6 % to 96.4 %."""
    mask = torch.zeros(height, width, dtype=torch.bool, device=device)
    mask[int(0.40810811 * height):int(0.99189189 * height), int(0.03594771 * width):int(0.96405229 * width)] = True
    return mask


def _scale_shift(pred: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per image (B, H, W): the ``s, t`` of least squares ``s * pred + t ~ target`` over ``valid`` (MiDaS's closed
    form of the 2x2 normal equations), each (B, 1, 1)."""
    m = valid.to(pred.dtype)
    a00, a01, a11 = (m * pred * pred).sum((1, 2)), (m * pred).sum((1, 2)), m.sum((1, 2))
    b0, b1 = (m * pred * target).sum((1, 2)), (m * target).sum((1, 2))
    det = a00 * a11 - a01 * a01
    ok = det.abs() > 1e-12
    safe = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (a11 * b0 - a01 * b1) / safe, torch.ones_like(det))
    t = torch.where(ok, (-a01 * b0 + a00 * b1) / safe, torch.zeros_like(det))
    return s[:, None, None], t[:, None, None]


def aligned(pred: Tensor, target: Tensor, valid: Tensor, how: str = "lstsq", max_depth: float | None = None
            ) -> Tensor:
    """A relative model's output (B, H, W) as depth comparable to ``target``: ``lstsq``: inverse depth fitted to the
    truth's inverse depth by a scale and a shift over the valid pixels, then inverted; ``median``: the output taken as
    depth up to scale, times the ratio of the medians. Clipped to (``1e-3``, ``max_depth``; by default the truth's
    deepest valid pixel)."""
    if how == "median":
        out = pred.clone()
        for i in range(len(pred)):
            v = valid[i]
            if v.any():
                out[i] = pred[i] * target[i][v].median() / pred[i][v].median().clamp(min=1e-6)
    elif how == "lstsq":
        disparity = torch.where(valid, 1 / target.clamp(min=1e-6), torch.zeros_like(target))
        s, t = _scale_shift(pred, disparity, valid)
        fitted = s * pred + t
        deepest = max_depth or float(target[valid].max()) if valid.any() else max_depth or 1.0
        out = 1 / fitted.clamp(min=1 / deepest)
        max_depth = deepest
    else:
        raise ValueError(f"how must be lstsq or median, got {how!r}")
    return out.clamp(min=1e-3, max=max_depth)


def depth_errors(pred: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """Per image (B, H, W), the errors of :data:`NAMES` over its valid pixels: (B, 8); NaN for an image without one."""
    m = valid.to(pred.dtype)
    n = m.sum((1, 2))
    p, g = pred.clamp(min=1e-6), torch.where(valid, target, torch.ones_like(target))
    ratio = torch.maximum(p / g, g / p)

    def mean(x: Tensor) -> Tensor:
        return (m * torch.where(valid, x, torch.zeros_like(x))).sum((1, 2)) / n

    rows = [mean((p - g).abs() / g), mean((p - g) ** 2 / g), mean((p - g) ** 2).sqrt(),
            mean((p.log() - g.log()) ** 2).sqrt(), mean((p.log10() - g.log10()).abs()),
            *(mean((ratio < 1.25 ** k).to(p.dtype)) for k in (1, 2, 3))]
    return torch.stack(rows, dim=1)


class DepthMetrics(Metric):
    """:func:`depth_errors` averaged over the images seen, on every rank; ``compute`` gives a dict of :data:`NAMES`
    and ``samples``."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("sums", default=torch.zeros(len(NAMES), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: Tensor, target: Tensor, valid: Tensor) -> None:
        errors = depth_errors(pred.float(), target.float(), valid).double()
        seen = torch.isfinite(errors).all(1)
        self.sums += errors[seen].sum(0)
        self.count += seen.sum()

    def compute(self) -> dict[str, float]:
        n = max(float(self.count), 1.0)
        return {**{k: float(v) / n for k, v in zip(NAMES, self.sums, strict=True)}, "samples": int(self.count)}


def _gradient_loss(residual: Tensor, valid: Tensor) -> Tensor:
    """MiDaS's gradient matching of one scale: the absolute differences of the residual between neighbours that are
    both valid, summed, per image (B,) with the count of valid pixels."""
    m = valid.to(residual.dtype)
    gx = (residual[:, :, 1:] - residual[:, :, :-1]).abs() * m[:, :, 1:] * m[:, :, :-1]
    gy = (residual[:, 1:] - residual[:, :-1]).abs() * m[:, 1:] * m[:, :-1]
    return gx.sum((1, 2)) + gy.sum((1, 2))


def _normalised(x: Tensor, valid: Tensor) -> Tensor:
    """Per image (B, H, W): ``(x - median) / mean |x - median|`` over the valid pixels (MiDaS's and Depth Anything's
    scale and shift, both estimated robustly; the scale is positive, so the sign of ``x`` is kept), 0 elsewhere."""
    out = torch.zeros_like(x)
    for i in range(len(x)):
        v = x[i][valid[i]]
        if v.numel() == 0:
            continue
        shift = v.median()
        scale = (v - shift).abs().mean().clamp(min=1e-6)
        out[i] = torch.where(valid[i], (x[i] - shift) / scale, torch.zeros_like(x[i]))
    return out


def ssi_loss(pred: Tensor, target: Tensor, valid: Tensor, gradient_weight: float = 0.5, scales: int = 4) -> Tensor:
    """The affine-invariant loss of Ranftl et al. (MiDaS, 2020) as Depth Anything trains relative depth: ``pred`` and
    ``target`` (B, H, W; inverse depth) each shifted by its median and divided by its mean absolute deviation over
    ``valid`` (a positive scale: an output of the wrong sign is not forgiven), the mean absolute difference over the
    batch's valid pixels, plus ``gradient_weight`` x MiDaS's gradient matching of the difference at ``scales`` scales
    (each halved), normalised by the valid pixels."""
    valid = valid & torch.isfinite(target)
    target = torch.where(valid, target, torch.zeros_like(target)).float()
    residual = _normalised(pred.float(), valid) - _normalised(target, valid)
    loss = residual.abs().sum() / valid.sum().clamp(min=1)
    if gradient_weight:
        r, v, total = residual, valid, residual.new_zeros(())
        for _ in range(scales):
            total = total + _gradient_loss(r, v).sum() / v.sum().clamp(min=1)
            r, v = r[:, ::2, ::2], v[:, ::2, ::2]
        loss = loss + gradient_weight * total
    return loss


def silog_loss(pred: Tensor, target: Tensor, valid: Tensor, lambd: float = 0.5) -> Tensor:
    """The scale-invariant log loss (Eigen et al., 2014) as Depth Anything's and BTS's metric training computes it:
    ``sqrt(mean(d²) - λ mean(d)²)`` of ``d = log target - log pred`` over the valid pixels."""
    valid = valid & torch.isfinite(target) & (target > 0)
    d = torch.log(target[valid].float()) - torch.log(pred[valid].float().clamp(min=1e-6))
    if d.numel() == 0:
        return pred.sum() * 0
    return (d.pow(2).mean() - lambd * d.mean().pow(2)).clamp(min=0).sqrt()


def resized_to(pred: Tensor, size: tuple[int, int]) -> Tensor:
    """A (B, h, w) map resized bilinearly to ``size`` (the truth's), as Depth Anything's evaluation upsamples."""
    if tuple(pred.shape[-2:]) == tuple(size):
        return pred
    return F.interpolate(pred[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def scored(pred: Tensor, depth: Tensor, kind: str, max_depth: float | None) -> tuple[Tensor, Tensor]:
    """One prediction (h, w) at its truth's size (H, W) as depth (a relative model's aligned by least squares in
    inverse depth), and the truth's valid pixels (at most ``max_depth`` where given)."""
    pred = resized_to(pred[None].float(), tuple(depth.shape[-2:]))
    depth = depth[None].float()
    valid = valid_mask(depth, max_depth=max_depth)
    if kind == "relative":
        pred = aligned(pred, depth, valid, "lstsq", max_depth)
    return pred[0], valid[0]


def coloured(values: Tensor | np.ndarray, low: float | None = None, high: float | None = None,
             cmap: str = "Spectral_r"):
    """A map as an RGB PIL image through ``cmap`` (Depth Anything's), from ``low`` to ``high`` (its range)."""
    from matplotlib import colormaps
    from PIL import Image

    v = np.asarray(values, dtype=np.float32)
    finite = v[np.isfinite(v)]
    low = float(finite.min()) if low is None and finite.size else (low or 0.0)
    high = float(finite.max()) if high is None and finite.size else (high if high is not None else 1.0)
    norm = np.clip((np.nan_to_num(v, nan=low) - low) / max(high - low, 1e-12), 0, 1)
    return Image.fromarray((colormaps[cmap](norm)[..., :3] * 255).astype(np.uint8))


def write_depth_report(result: dict, out: str | os.PathLike, mean, std, extra: dict) -> dict:
    """``metrics.json`` (Eigen's errors, the images scored, ``extra``) and ``worst/``: the images of highest AbsRel,
    each the image, the prediction, the truth and the absolute error side by side (depth coloured on the truth's
    range, near warm and far cool as ``vitkit predict`` draws it; no measurement black)."""
    import json

    from PIL import Image

    out = Path(out)
    (out / "worst").mkdir(parents=True, exist_ok=True)
    metrics = {**result["metrics"], **extra}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    for rank, (absrel, index, x, pred, depth, valid) in enumerate(result["worst"]):
        image = (x.float().cpu() * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)).clamp(0, 1)
        h, w = depth.shape
        shown = Image.fromarray((image.permute(1, 2, 0).numpy() * 255).astype(np.uint8)).resize((w, h))
        low, high = float(depth[valid].min()), float(depth[valid].max())
        truth = np.where(valid.numpy(), depth.numpy(), np.nan)
        panels = [shown, coloured(pred.numpy(), low, high, "Spectral"), coloured(truth, low, high, "Spectral"),
                  coloured(np.where(valid.numpy(), (pred - depth).abs().numpy(), np.nan), 0, None, "magma")]
        for p, v in zip(panels[1:], (None, truth, truth), strict=True):  # no measurement: black
            if v is not None:
                array = np.asarray(p).copy()
                array[~np.isfinite(v)] = 0
                p.paste(Image.fromarray(array))
        sheet = Image.new("RGB", (4 * w, h))
        for k, p in enumerate(panels):
            sheet.paste(p, (k * w, 0))
        sheet.save(out / "worst" / f"{rank:02d}_image{index}_absrel{absrel:.3f}.png")
    return metrics
