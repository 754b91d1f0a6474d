"""``vitkit evaluate`` of a detector (the task protocol's evaluator): a ``vitkit.lit.Detector`` checkpoint, or its
ONNX export, over a split of a COCO or YOLO folder: COCO's AP and AR, AP per class, the split's truth and the
detections in COCO's formats, a precision-recall plot and the worst images (``vitkit.evaluation.detection``)."""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from vitkit.data.detection import YOLO_YAMLS
from vitkit.errors import UsageError
from vitkit.evaluation.detection import image_f1, write_detection_report
from vitkit.evaluation.setup import Autocast, build_data, pick_split

from .inference import _Detector, load_detector_checkpoint

WORST = 8


def evaluate(cfg, explicit: set[str], device: torch.device, onnx=None) -> int:
    """Score the model of ``cfg`` (``--checkpoint``, or ``onnx``: its export in onnxruntime) on ``cfg.data``; the
    data module's size and normalisation are the model's where the command line leaves them."""
    if cfg.mode != "resized" or cfg.stride is not None:
        raise UsageError("--mode and --stride apply to a segmenter; a detector is scored on its letterboxed input")
    if onnx is not None:
        (_, size, _), names = onnx.meta["input_size"], list(onnx.labels or [])
        mean, std = tuple(onnx.meta["mean"]), tuple(onnx.meta["std"])
        run = lambda x: tuple(torch.from_numpy(np.asarray(o)) for o in onnx.outputs(x.float().cpu().numpy()))  # noqa: E731
        if cfg.precision != "32-true":
            raise UsageError("--precision applies to a checkpoint; an ONNX file runs as it was exported")
        max_detections = 100
    else:
        net = load_detector_checkpoint(cfg.checkpoint).to(device)
        names, size = net.class_names, net.cfg.img_size if isinstance(net.cfg.img_size, int) else net.cfg.img_size[0]
        mean, std, max_detections = tuple(net.cfg.mean), tuple(net.cfg.std), net.max_detections
        run = net if cfg.precision == "32-true" else Autocast(net, device)
    init = cfg.data.init_args
    if "names" in init and "names" not in explicit and init["names"] is None and init.get("root") and \
            not any((Path(init["root"]) / n).is_file() for n in YOLO_YAMLS):  # VOC: the files name no list
        init["names"] = names
    dm = build_data(cfg, {"img_size": size, "mean": mean, "std": std}, explicit, False)
    if dm.classes != names:
        raise UsageError(f"the model detects {len(names)} classes ({', '.join(names[:6])}...) and the data names "
                         f"{len(dm.classes)} ({', '.join(dm.classes[:6])}...): evaluate it on data of its own classes")
    split, ds = pick_split(dm, cfg.split)
    result = _run(run, dm, ds, device, max_detections)
    out = Path(cfg.out)
    metrics = write_detection_report(result, names, out, dm.data_cfg.mean, dm.data_cfg.std, {"split": split})
    scored = {k: v for k, v in metrics["per_class_AP"].items() if v >= 0}  # -1: the split holds none of the class
    weakest = ", ".join(f"{k} {v:.3f}" for k, v in sorted(scored.items(), key=lambda kv: kv[1])[:5])
    absent = sorted(set(metrics["per_class_AP"]) - set(scored))
    print(f"{dm.describe()} ({split}):\nmAP {metrics['mAP']:.4f}  AP50 {metrics['AP50']:.4f}  AP75 "
          f"{metrics['AP75']:.4f}  AR100 {metrics['AR100']:.4f}  ({metrics['samples']} images, {len(names)} classes)"
          f"\nweakest classes (AP): {weakest or '-'}"
          + (f"\nnot in this split (no AP): {', '.join(absent)}" if absent else "") + f"\n-> {out}")
    return 0


@torch.no_grad()
def _run(run, dm, ds, device: torch.device, max_detections: int) -> dict:
    """Every image's detections and truth in its own pixels, its size, and the worst images by F1."""
    picker = _Detector()
    picker.max_detections, picker.size = max_detections, dm.hparams.img_size
    predictions, truths, sizes, worst, index = [], [], [], [], 0
    from vitkit.models.detection import truths as in_pixels

    for batch in dm.loader(ds, False):
        x, targets = dm.on_after_batch_transfer((batch[0].to(device), batch[1]), 0)
        outputs = tuple(o.float().cpu() for o in run(x))
        size = [tuple(int(v) for v in t["size"]) for t in targets]
        found = picker.found(outputs, size)
        truth = in_pixels(targets, x.shape[-1])
        for i, (pred, true) in enumerate(zip(found, truth, strict=True)):
            f1 = image_f1(pred, true)
            item = (-f1, index, x[i].cpu(), pred, true, size[i])
            if len(worst) < WORST:
                heapq.heappush(worst, item)
            elif item > worst[0]:
                heapq.heapreplace(worst, item)
            index += 1
        predictions += found
        truths += truth
        sizes += size
    ranked = sorted(worst, reverse=True)
    return {"predictions": predictions, "truths": truths, "sizes": sizes,
            "worst": [(-f1, i, x, p, t, s) for f1, i, x, p, t, s in ranked]}
