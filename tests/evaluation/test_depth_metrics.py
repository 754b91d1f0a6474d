"""Depth's scores and losses (``vitkit.evaluation.depth``) against their definitions written out in numpy (as Depth
Anything's ``eval_depth`` computes them), on valid pixels only."""

import numpy as np
import pytest
import torch

from vitkit.evaluation.depth import (
    NAMES,
    DepthMetrics,
    aligned,
    depth_errors,
    eigen_crop,
    silog_loss,
    ssi_loss,
    valid_mask,
)


def _reference(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    thresh = np.maximum(target / pred, pred / target)
    diff, diff_log = pred - target, np.log(pred) - np.log(target)
    return {"AbsRel": np.mean(np.abs(diff) / target), "SqRel": np.mean(diff ** 2 / target),
            "RMSE": np.sqrt(np.mean(diff ** 2)), "RMSE_log": np.sqrt(np.mean(diff_log ** 2)),
            "log10": np.mean(np.abs(np.log10(pred) - np.log10(target))),
            **{f"delta{k}": np.mean(thresh < 1.25 ** k) for k in (1, 2, 3)}}


def _maps(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(3, 20, 30, generator=g) * 9 + 1
    target[0, :5] = 0  # no measurement (KITTI's sparse maps)
    target[1, 3, 4] = float("nan")
    pred = target * torch.exp(torch.randn(3, 20, 30, generator=g) * 0.2)
    pred = torch.nan_to_num(pred, nan=3.0).clamp(min=0.5)
    return pred, target


def test_the_errors_are_eigens_on_the_valid_pixels_of_each_image_averaged_over_images():
    pred, target = _maps()
    valid = valid_mask(target)
    metric = DepthMetrics()
    metric.update(pred[:2], target[:2], valid[:2])
    metric.update(pred[2:], target[2:], valid[2:])
    result = metric.compute()
    per_image = [_reference(pred[i][valid[i]].numpy().astype(np.float64), target[i][valid[i]].numpy())
                 for i in range(3)]
    for name in NAMES:
        assert result[name] == pytest.approx(np.mean([r[name] for r in per_image]), rel=1e-5), name
    assert result["samples"] == 3
    assert 0 < result["AbsRel"] < 0.5 and 0.3 < result["delta1"] < 1  # neither perfect nor empty
    empty = depth_errors(pred[:1], torch.zeros_like(target[:1]), torch.zeros_like(valid[:1]))
    assert torch.isnan(empty).all()  # an image without a measurement scores nothing


def test_a_relative_prediction_is_aligned_by_scale_and_shift_in_inverse_depth():
    _, target = _maps(1)
    valid = valid_mask(target)
    inverse = torch.where(valid, 1 / target, torch.zeros_like(target))
    pred = 3.0 * inverse + 0.7  # an affine inverse depth: exactly the truth once aligned
    torch.testing.assert_close(aligned(pred, target, valid)[valid], target[valid], rtol=1e-4, atol=1e-4)
    median = aligned(target * 5, target, valid, "median")
    torch.testing.assert_close(median[valid], target[valid], rtol=1e-5, atol=1e-5)


def test_the_losses_are_invariant_where_they_say_and_zero_at_the_truth():
    pred, target = _maps(2)
    valid = valid_mask(target)
    disparity = torch.where(valid, 1 / target, torch.zeros_like(target))
    assert float(ssi_loss(4 * disparity + 2, disparity, valid)) == pytest.approx(0, abs=1e-5)
    a, b = ssi_loss(pred, disparity, valid), ssi_loss(7 * pred - 1, disparity, valid)
    assert float(a) > 0.01 and float(a) == pytest.approx(float(b), rel=1e-4)  # scale and shift do not matter
    assert float(ssi_loss(-disparity, disparity, valid)) > 1  # a positive scale: the wrong sign is no fit
    d = torch.log(target[valid]) - torch.log(pred[valid])
    expected = torch.sqrt((d ** 2).mean() - 0.5 * d.mean() ** 2)
    assert float(silog_loss(pred, target, valid)) == pytest.approx(float(expected), rel=1e-5)
    assert float(silog_loss(pred * 3, target, valid, lambd=1.0)) == pytest.approx(
        float(silog_loss(pred, target, valid, lambd=1.0)), rel=1e-4)  # λ = 1: a global scale does not matter


def test_the_eigen_crop_is_gargs():
    crop = eigen_crop(375, 1242)
    rows, cols = crop.any(1).nonzero().flatten(), crop.any(0).nonzero().flatten()
    assert (int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])) == (153, 370, 44, 1196)
