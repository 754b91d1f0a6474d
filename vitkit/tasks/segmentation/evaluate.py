"""``vitkit evaluate`` of a segmenter (the task protocol's evaluator): a ``vitkit.lit.Segmenter`` checkpoint, or its
ONNX export, over a split of a folder of images and masks: mIoU, pixel accuracy, IoU per class, the confusion matrix
and the worst images (``vitkit.evaluation.segmentation``)."""

from __future__ import annotations

from pathlib import Path

import torch

from vitkit.errors import UsageError
from vitkit.evaluation.segmentation import MODES, evaluate_masks, segment_logits, write_segmentation_report
from vitkit.evaluation.setup import Autocast, build_data, pick_split, window_stride
from vitkit.models.config import pair

from .inference import load_segmenter_checkpoint


def evaluate(cfg, explicit: set[str], device: torch.device, onnx=None) -> int:
    """Score the model of ``cfg`` (``--checkpoint``, or ``onnx``: its export in onnxruntime) on ``cfg.data``; the
    data module's class count, class names, ignored value and preprocessing are the model's where the command line
    leaves them."""
    if cfg.mode not in ("resized", *MODES):
        raise UsageError(f"--mode must be resized, whole or slide, got {cfg.mode!r}")
    if onnx is not None:  # the export's own preprocessing and class names (its metadata); run in onnxruntime
        (_, h, w), names, ignore_index = onnx.meta["input_size"], list(onnx.labels or []), None
        mean, std = tuple(onnx.meta["mean"]), tuple(onnx.meta["std"])
        model = lambda x: torch.from_numpy(onnx(x.float().cpu().numpy()))  # noqa: E731
        if cfg.precision != "32-true":
            raise UsageError("--precision applies to a checkpoint; an ONNX file runs as it was exported")
    else:
        net = load_segmenter_checkpoint(cfg.checkpoint).to(device)  # the run's model: what it validated
        names, ignore_index = net.class_names, net.ignore_index
        (h, w), mean, std = pair(net.cfg.img_size), tuple(net.cfg.mean), tuple(net.cfg.std)
        model = net if cfg.precision == "32-true" else Autocast(net, device)
    prep = {"img_size": h if h == w else (h, w), "mean": mean, "std": std}
    init = cfg.data.init_args
    for key, value in (("ignore_index", ignore_index), ("classes", names), ("num_classes", len(names))):
        if key not in explicit and key in init and value is not None:
            init[key] = value
    dm = build_data(cfg, prep, explicit, False)  # SegmentationDataModule takes img_size, mean and std of these
    if dm.num_classes != len(names):
        raise UsageError(f"the model has {len(names)} classes and the data {dm.num_classes}: evaluate it on masks of "
                         "its own classes")
    split, ds = pick_split(dm, cfg.split)
    if cfg.mode != "resized":  # each image and mask as they are, one at a time
        stride = window_stride(cfg.stride)
        ds, dm.hparams.batch_size, model = dm.eval_view(split, own_size=True), 1, \
            (lambda x, run=model: segment_logits(run, x, (h, w), cfg.mode, stride))
    result = evaluate_masks(model, dm.loader(ds, False), len(names), dm.ignore_index, device,
                            prepare=lambda batch: dm.on_after_batch_transfer(batch, 0))
    out = Path(cfg.out)
    metrics = write_segmentation_report(result, names, out, dm.data_cfg.mean, dm.data_cfg.std,
                                        {"split": split, "mode": cfg.mode})
    seen = {k: v for k, v in metrics["per_class_iou"].items() if v is not None}
    weakest = ", ".join(f"{k} {v:.3f}" for k, v in sorted(seen.items(), key=lambda kv: kv[1])[:5])
    print(f"{dm.describe()} ({split}):\nmIoU {metrics['mIoU']:.4f}  pixel accuracy {metrics['pixel_acc']:.4f}  "
          f"({metrics['samples']} images, {len(names)} classes)\nweakest classes (IoU): {weakest}\n-> {out}")
    return 0
