"""``vitkit evaluate`` of a depth model (the task protocol's evaluator): a ``vitkit.lit.DepthEstimator`` checkpoint, or
its ONNX export, over a split of a folder of images and depth maps: Eigen's errors on each map's valid pixels at its
own size (a relative model's output aligned first), and the worst images (``vitkit.evaluation.depth``)."""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from vitkit.errors import UsageError
from vitkit.evaluation.depth import DepthMetrics, depth_errors, scored, write_depth_report
from vitkit.evaluation.setup import Autocast, build_data, pick_split

from .inference import load_depth_checkpoint

WORST = 8


def evaluate(cfg, explicit: set[str], device: torch.device, onnx=None) -> int:
    """Score the model of ``cfg`` (``--checkpoint``, or ``onnx``: its export in onnxruntime) on ``cfg.data``; the
    data module's size, normalisation and depth range are the model's where the command line leaves them."""
    if cfg.mode != "resized" or cfg.stride is not None:
        raise UsageError("--mode and --stride apply to a segmenter; a depth model is scored on its resized input")
    if onnx is not None:
        (_, size, _), mean, std = onnx.meta["input_size"], tuple(onnx.meta["mean"]), tuple(onnx.meta["std"])
        depth = onnx.meta.get("depth") or {}
        kind, max_depth = depth.get("kind", "relative"), depth.get("max_depth")
        run = lambda x: torch.from_numpy(np.asarray(onnx(x.float().cpu().numpy())))  # noqa: E731
        if cfg.precision != "32-true":
            raise UsageError("--precision applies to a checkpoint; an ONNX file runs as it was exported")
    else:
        net = load_depth_checkpoint(cfg.checkpoint).to(device)
        size = net.cfg.img_size if isinstance(net.cfg.img_size, int) else net.cfg.img_size[0]
        mean, std, kind, max_depth = tuple(net.cfg.mean), tuple(net.cfg.std), net.kind, net.max_depth
        run = net if cfg.precision == "32-true" else Autocast(net, device)
    init = cfg.data.init_args
    if "max_depth" not in explicit and "max_depth" in init and max_depth is not None:
        init["max_depth"] = max_depth
    dm = build_data(cfg, {"img_size": size, "mean": mean, "std": std}, explicit, False)
    if not hasattr(dm, "max_depth"):
        raise UsageError(f"a depth model is scored on images with depth maps (vitkit.lit.DepthDataModule, "
                         f"--data.root DIR), not {type(dm).__name__}")
    split, ds = pick_split(dm, cfg.split)
    result = _run(run, dm, ds, device, kind, dm.max_depth)
    out = Path(cfg.out)
    metrics = write_depth_report(result, out, dm.data_cfg.mean, dm.data_cfg.std,
                                 {"split": split, "kind": kind, "max_depth": dm.max_depth})
    print(f"{dm.describe()} ({split}):\nAbsRel {metrics['AbsRel']:.4f}  RMSE {metrics['RMSE']:.4f}  delta1 "
          f"{metrics['delta1']:.4f}  ({metrics['samples']} images, {kind} depth"
          f"{', aligned by scale and shift' if kind == 'relative' else ''})\n-> {out}")
    return 0


@torch.no_grad()
def _run(run, dm, ds, device: torch.device, kind: str, max_depth: float | None) -> dict:
    """The errors over the split, and its worst images by AbsRel (their input, prediction, truth and valid mask)."""
    metric, worst, index = DepthMetrics(), [], 0
    for batch in dm.loader(ds, False):
        x, depths = dm.on_after_batch_transfer((batch[0].to(device), batch[1]), 0)
        for i, (pred, depth) in enumerate(zip(run(x).float().cpu(), depths, strict=True)):
            p, valid = scored(pred, depth.float(), kind, max_depth)
            metric.update(p[None], depth[None].float(), valid[None])
            absrel = float(depth_errors(p[None], depth[None].float(), valid[None])[0, 0])
            if np.isfinite(absrel):
                item = (absrel, index, x[i].cpu(), p, depth.float(), valid)
                if len(worst) < WORST:
                    heapq.heappush(worst, item)
                elif item > worst[0]:
                    heapq.heapreplace(worst, item)
            index += 1
    return {"metrics": metric.compute(), "worst": sorted(worst, reverse=True)}
