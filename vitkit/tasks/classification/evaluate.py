"""``vitkit evaluate`` of a classifier (the task protocol's evaluator): a checkpoint, a tag or an ONNX file over a split
of any data module, into a folder of scores and pictures (``vitkit.evaluation``); one label per image or several (at
the model's thresholds, or at thresholds chosen on the split); a backbone by k-NN and a linear probe on its
features."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vitkit.errors import UsageError
from vitkit.evaluation.metrics import summary
from vitkit.evaluation.multilabel import THRESHOLD_MODES, choose_thresholds, multilabel_summary, write_multilabel_report
from vitkit.evaluation.predict import backbone_scores, predict, width
from vitkit.evaluation.report import write_backbone_report, write_report
from vitkit.evaluation.setup import Autocast, build_data, pick_split
from vitkit.models.config import pair
from vitkit.models.packing import PackedBatch


def evaluate(cfg, explicit: set[str], device: torch.device, onnx=None) -> int:
    """Score the model of ``cfg`` (``--checkpoint``, ``--model``, or ``onnx``: an export in onnxruntime) on
    ``cfg.data``, or with ``--knn`` / ``--linear-probe`` its features; the data module's preprocessing is the
    model's where the command line leaves it."""
    if cfg.mode != "resized" or cfg.stride is not None:
        raise UsageError("--mode and --stride score a segmentation checkpoint (vitkit.lit.Segmenter); "
                         f"{cfg.checkpoint or cfg.model or cfg.onnx} is not one")
    size = cfg.data.init_args.get("img_size") if "img_size" in explicit else None
    model, names, prep, thresholds = _model(cfg, device, size, onnx)
    if cfg.precision == "bf16-mixed":
        model = Autocast(model, device)
    backbone = cfg.knn or cfg.linear_probe
    if not backbone and names is None:
        raise UsageError(f"{cfg.checkpoint or cfg.model} has no classifier head (a backbone): score its features "
                         "with --knn or --linear-probe, or fine-tune it first")
    dm = build_data(cfg, prep, explicit, eval_train=backbone, model=model)
    names = names or getattr(dm, "classes", None)
    split, ds = pick_split(dm, cfg.split)
    out = Path(cfg.out)
    if backbone:
        result = backbone_scores(model, dm, ds, device, cfg.knn, cfg.linear_probe, cfg.k, cfg.temperature)
        write_backbone_report(result, out)
        print(", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.endswith("_top1")) + f"  -> {out}")
        return 0
    classes, data_classes = width(model, dm, ds, device), getattr(dm, "classes", None) or names
    if len(data_classes) != classes:  # the model's own names may not count the data's labels
        raise UsageError(f"the model has {classes} classes and the data {len(data_classes)}: evaluate it on data of "
                         "its own classes")
    if getattr(dm, "multi_label", False) and thresholds is None:
        raise UsageError(f"{dm.describe()} gives several labels per image, and the model is a single-label "
                         "classifier (a softmax over its classes): evaluate a model trained with --model.labels "
                         "MultiLabel")
    if cfg.thresholds is not None and (thresholds is None or cfg.thresholds not in THRESHOLD_MODES):
        raise UsageError(f"--thresholds expects one of {', '.join(THRESHOLD_MODES)}, for a multi-label model; got "
                         f"{cfg.thresholds!r}" + ("" if thresholds is not None else " for a single-label model"))
    pred = predict(model, dm, ds, device, thresholds, names)
    if cfg.thresholds is not None:  # chosen on this split; the mistakes are those at the new thresholds
        thresholds = choose_thresholds(pred.probs, pred.labels, cfg.thresholds)
        if hasattr(dm, "reset_counts"):
            dm.reset_counts()
        pred = predict(model, dm, ds, device, thresholds, names)
    skipped = sum(getattr(dm, "skipped", {}).values())  # unreadable images, counted by the data module
    extra = {"skipped": skipped, "split": split}
    if thresholds is not None:
        result = write_multilabel_report(pred, names, thresholds, out, extra)
        text = multilabel_summary(result)
    else:
        result = write_report(pred, names, out, cfg.topk, extra)
        text = summary(result)
    print(f"{dm.describe()} ({split}):\n{text}\n-> {out}")
    return 0


def _model(cfg, device: torch.device, img_size: int | tuple[int, int] | None = None,
           onnx=None) -> tuple[Any, list[str] | None, dict, torch.Tensor | None]:
    """(a callable from a batch to logits or features, the class names or None for a backbone, the model's
    preprocessing for the data module, a multi-label model's thresholds or None); ``img_size``: the size given for
    the data, the model's too (positions and windows resized on load)."""
    if onnx is not None:
        net = onnx
        if not net.labels:
            raise UsageError(f"{cfg.onnx} records no class names (no vitkit.labels metadata): export it from a "
                             "checkpoint that has them (`vitkit export CKPT`), or evaluate the checkpoint itself")
        c, h, w = net.meta["input_size"]
        prep = {"img_size": h if h == w else (h, w), "crop_mode": net.meta.get("crop_mode", "center"),
                **{k: net.meta[k] for k in ("mean", "std", "crop_pct", "interpolation")}}
        thresholds = None if net.thresholds is None else torch.tensor(net.thresholds)
        if "max_patches" in net.meta:  # whole images within the budget, as the checkpoint is evaluated: packed
            # batches, run as they are by a --packed file, image by image through any other (it takes any size)
            prep.update(packing=True, max_patches=net.meta["max_patches"])
            return PackedOnnx(net), list(net.labels), prep, thresholds
        return (lambda x: torch.from_numpy(net(x.float().cpu().numpy()))), list(net.labels), prep, thresholds
    import vitkit

    overrides = {"token_merging": cfg.token_merging} if cfg.token_merging else {}
    if img_size is not None:
        overrides["img_size"] = img_size
    net = vitkit.create_model(cfg.model, checkpoint=cfg.checkpoint, pretrained=cfg.checkpoint is None,
                              **overrides).eval().to(device)
    report = getattr(net, "load_report", None)
    headless = net.cfg.num_classes == 0 or (report is not None and bool(report.new_head))
    names = None if headless else (getattr(net, "class_names", None) or
                                   [str(i) for i in range(net.cfg.num_classes)])
    h, w = pair(net.cfg.img_size)
    prep = {"img_size": h if h == w else (h, w), "mean": tuple(net.cfg.mean), "std": tuple(net.cfg.std),
            "crop_pct": net.cfg.crop_pct, "interpolation": net.cfg.interpolation,
            "crop_mode": getattr(net.cfg, "crop_mode", "center")}
    if getattr(net.cfg, "max_patches", None) is not None:  # trained on packed batches: evaluated so by default
        prep.update(packing=True, max_patches=net.cfg.max_patches)
    net.features = lambda x: net.forward_packed(x, pre_logits=True) if isinstance(x, PackedBatch) else \
        net.forward_head(net.forward_features(x), pre_logits=True)
    thresholds = None if getattr(net, "thresholds", None) is None else torch.tensor(net.thresholds)
    return net, names, prep, thresholds


class PackedOnnx:
    """The ONNX export of a model trained on packed batches as evaluate runs it: the data module's packed batches to
    logits. A ``--packed`` file takes them as they are (packed for its patch size and prefix tokens); any other runs
    each image of them alone, at its own size, as ``vitkit predict --onnx`` does."""

    def __init__(self, net) -> None:
        self.net, self.patch_size = net, net.meta["patch_size"]
        self.num_prefix_tokens = net.meta["prefix"] if net.packed else 0  # a plain file: no sequence to fit
        self.cfg = SimpleNamespace(num_classes=len(net.labels))

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        if not self.net.packed:
            return torch.from_numpy(np.concatenate([self.net(image[None].float().cpu().numpy())
                                                    for image in batch.images()]))
        grids = np.asarray(batch.grids, dtype=np.int64).reshape(-1, 2)
        return torch.from_numpy(self.net.run_packed(batch.patches.float().cpu().numpy(), batch.image.cpu().numpy(),
                                                    batch.index.cpu().numpy(), grids))

    def __call__(self, x) -> torch.Tensor:
        return self.forward_packed(x) if isinstance(x, PackedBatch) else \
            torch.from_numpy(self.net(x.float().cpu().numpy()))
