"""``vitkit evaluate``: a classifier (a checkpoint, a tag or an ONNX file) over a split of any data module, into a
folder of scores and pictures (``vitkit.evaluation``); a backbone by k-NN and a linear probe on its features.

The data comes by the training command's ``--data`` arguments (``--data.root DIR`` alone means an image folder);
the data module's preprocessing defaults to the model's own (its size, mean, std, crop and interpolation).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import torch
from jsonargparse import ArgumentParser

from vitkit.evaluation.metrics import summary
from vitkit.evaluation.multilabel import THRESHOLD_MODES, choose_thresholds, multilabel_summary, write_multilabel_report
from vitkit.evaluation.predict import backbone_scores, predict, width
from vitkit.evaluation.report import write_backbone_report, write_report
from vitkit.models.config import pair
from vitkit.models.packing import PackedBatch

PREPROCESSING = ("img_size", "mean", "std", "crop_pct", "interpolation", "crop_mode", "packing", "max_patches")
PRECISIONS = ("32-true", "bf16-mixed")


class _Autocast:
    """``model`` under bf16 autocast, as Lightning's bf16-mixed runs validation: a call of it, of its ``features``
    and of its ``forward_packed`` runs under autocast; any other attribute (its config, patch size) is the model's."""

    def __init__(self, model, device: torch.device) -> None:
        self._model, self._device = model, device

    def _autocast(self, fn):
        def wrapped(*args, **kwargs):
            with torch.autocast(self._device.type, dtype=torch.bfloat16):
                return fn(*args, **kwargs)
        return wrapped

    def __call__(self, *args, **kwargs):
        return self._autocast(self._model)(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._model, name)
        return self._autocast(value) if name in ("features", "forward_packed") else value


def parser() -> ArgumentParser:
    from . import COMMANDS
    from .train import OneLineLightningParser

    p = OneLineLightningParser(prog="vitkit evaluate", description=f"{COMMANDS['evaluate']}. The data: --data.root DIR "
                               "(an image folder), or --data CLASS with its arguments, as for `vitkit train`.")
    p.add_argument("--checkpoint", type=str | None, default=None, help="any checkpoint or weights file vitkit reads")
    p.add_argument("--model", type=str | None, default=None, help="a preset or timm tag (pretrained, by name); with "
                   "--checkpoint, the preset the file holds (by default the one it records, or the one its shapes fit)")
    p.add_argument("--onnx", type=str | None, default=None, help="a file written by `vitkit export`")
    p.add_argument("-o", "--out", type=str, required=True, help="the folder the results go into")
    p.add_argument("--split", type=str | None, default=None, help="test or val (default: test where the data has "
                                                                   "one, else val)")
    p.add_argument("--knn", type=bool, default=False, help="k-NN top-1 of the pooled features (DINO's vote)")
    p.add_argument("--linear-probe", type=bool, default=False, help="logistic-regression top-1 on the features")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.07)
    p.add_argument("--token-merging", type=int, default=0, help="ToMe: merge R tokens per block")
    p.add_argument("--topk", type=int, default=5, help="classes per row of predictions.csv")
    p.add_argument("--thresholds", type=str | None, default=None, help="a multi-label model: per_class, global or "
                   "fixed: choose the thresholds on this split (maximum F1; fixed: 0.5) instead of the model's own, "
                   "and score with them (metrics.json holds them)")
    p.add_argument("--mode", type=str, default="resized", help="a segmenter: resized (images and masks at the "
                   "model's size, as the run validated), whole (each image resized to the model's size, the logits "
                   "back to the image's, scored against the mask as it is) or slide (windows of the model's size "
                   "over each image as it is, --stride apart, scored against the mask as it is)")
    p.add_argument("--stride", type=int | list[int] | None, default=None, help="--mode slide: the windows' step, "
                   "one number or [H, W] (default two thirds of the model's size)")
    p.add_argument("--device", type=str, default="auto")
    p.add_argument("--precision", type=str, default="32-true", help="32-true, or bf16-mixed (bf16 autocast: what a "
                   "run trained with --trainer.precision bf16-mixed validated with; float32 scores differ slightly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_subclass_arguments(L.LightningDataModule, "data", required=False, fail_untyped=False,
                             help="the data module: --data.root DIR (an image folder), or --data CLASS with its "
                                  "arguments, as for `vitkit train` (`--data.help CLASS` lists them)")
    p.groups["data"].title = "the data"  # not the first line of LightningDataModule's docstring
    return p


def _argv(argv: list[str]) -> list[str]:
    """``--data.root DIR`` without ``--data CLASS`` is an image folder, or for a segmentation checkpoint a folder of
    images and masks (and a bare ``--flag`` is ``--flag true``)."""
    named = any(a == "--data" or a.startswith("--data=") for a in argv)
    seg = _segmentation_checkpoint(argv) if named or any(a.startswith("--data.") for a in argv) else None
    if not named and any(a.startswith("--data.") for a in argv):
        argv = ["--data", "vitkit.lit.SegmentationDataModule" if seg else "vitkit.lit.ImageFolderDataModule", *argv]
    if seg and not any(a.startswith("--data.num_classes") for a in argv):  # the model's own classes
        argv = [*argv, "--data.num_classes", str(seg["num_classes"])]
    flags = ("--knn", "--linear-probe")
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a in flags and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("true")
    return out


def _segmentation_checkpoint(argv: list[str]) -> dict | None:
    """Where the ``--checkpoint`` given is a ``vitkit.lit.Segmenter``'s, its hyper-parameters; where the ``--onnx``
    file given is a segmenter's export, its class count; else None."""
    from .predict import segmentation_checkpoint

    for flag in ("--checkpoint", "--onnx"):
        for i, a in enumerate(argv):
            value = a.partition("=")[2] if a.startswith(flag + "=") else argv[i + 1] if a == flag and \
                i + 1 < len(argv) else None
            if value and flag == "--checkpoint":
                return segmentation_checkpoint(value)
            if value:
                return _segmentation_onnx(value)
    return None


@functools.cache
def _onnx(path: str):
    """The export at ``path`` in onnxruntime, loaded once however often the command asks."""
    from vitkit.tools.onnx_model import OnnxModel

    return OnnxModel(path)


def _segmentation_onnx(path: str) -> dict | None:
    """``{"num_classes": N}`` where ``path`` is a segmenter's ONNX export (its ``vitkit.task`` metadata), else None
    (a file that does not load says so where the model is loaded)."""
    try:
        net = _onnx(path)
    except Exception:  # noqa: BLE001 - loaded again by the command, whose error names the file
        return None
    return {"num_classes": len(net.labels or [])} if net.meta.get("task") == "segmentation" else None


def parse_args(argv: list[str]):
    """The parsed command line (``--data.root DIR`` alone: an image folder; a bare ``--knn``: true)."""
    return parser().parse_args(_argv(argv))


def main(argv: list[str]) -> int:
    p = parser()
    cfg = p.parse_args(_argv(argv))
    if (cfg.onnx is not None) == (cfg.checkpoint is not None or cfg.model is not None):
        p.error("give --checkpoint FILE (with --model NAME to name its preset), --model NAME or --onnx FILE")
    if cfg.data is None:
        p.error("give the data: --data.root DIR (an image folder), or --data CLASS with its arguments")
    L.seed_everything(cfg.seed, verbose=False)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    if cfg.precision not in PRECISIONS:
        p.error(f"--precision expects one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    explicit = {a[len("--data."):].split("=")[0] for a in argv if a.startswith("--data.")}
    if _segmentation_checkpoint(["--checkpoint", cfg.checkpoint] if cfg.checkpoint else
                                ["--onnx", cfg.onnx] if cfg.onnx else []) is not None:
        return _evaluate_segmentation(p, cfg, explicit, device)
    _refuse_segmentation_flags(cfg)
    size = cfg.data.init_args.get("img_size") if "img_size" in explicit else None
    model, names, prep, thresholds = _model(cfg, device, size)
    if cfg.precision == "bf16-mixed":
        model = _Autocast(model, device)
    backbone = cfg.knn or cfg.linear_probe
    if not backbone and names is None:
        raise ValueError(f"{cfg.checkpoint or cfg.model} has no classifier head (a backbone): score its features "
                         "with --knn or --linear-probe, or fine-tune it first")
    dm = _data(p, cfg, prep, explicit, eval_train=backbone, model=model)
    names = names or getattr(dm, "classes", None)
    split, ds = _split(dm, cfg.split)
    out = Path(cfg.out)
    if backbone:
        result = backbone_scores(model, dm, ds, device, cfg.knn, cfg.linear_probe, cfg.k, cfg.temperature)
        write_backbone_report(result, out)
        print(", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.endswith("_top1")) + f"  -> {out}")
        return 0
    classes, data_classes = width(model, dm, ds, device), getattr(dm, "classes", None) or names
    if len(data_classes) != classes:  # the model's own names may not count the data's labels
        raise ValueError(f"the model has {classes} classes and the data {len(data_classes)}: evaluate it on data of "
                         "its own classes")
    if getattr(dm, "multi_label", False) and thresholds is None:
        raise ValueError(f"{dm.describe()} gives several labels per image, and the model is a single-label "
                         "classifier (a softmax over its classes): evaluate a model trained with --model.multi_label")
    if cfg.thresholds is not None and (thresholds is None or cfg.thresholds not in THRESHOLD_MODES):
        p.error(f"--thresholds expects one of {', '.join(THRESHOLD_MODES)}, for a multi-label model; got "
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


def _model(cfg, device: torch.device,
           img_size: int | tuple[int, int] | None = None) -> tuple[Any, list[str] | None, dict, torch.Tensor | None]:
    """(a callable from a batch to logits or features, the class names or None for a backbone, the model's
    preprocessing for the data module, a multi-label model's thresholds or None); ``img_size``: the size given for
    the data, the model's too (positions and windows resized on load)."""
    if cfg.onnx:
        net = _onnx(cfg.onnx)
        if not net.labels:
            raise ValueError(f"{cfg.onnx} records no class names (no vitkit.labels metadata): export it from a "
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


def _data(p: ArgumentParser, cfg, prep: dict, explicit: set[str], eval_train: bool,
          model=None) -> L.LightningDataModule:
    """The data module, its preprocessing the model's where the command line (``explicit``) leaves it; for a
    backbone, its train split in the eval transform (features of the images as they are)."""
    from importlib import import_module

    module, _, name = cfg.data.class_path.rpartition(".")
    klass = getattr(import_module(module), name)
    accepted = set()
    for c in klass.__mro__:
        if "__init__" in vars(c):
            accepted |= set(inspect.signature(c.__init__).parameters)
    args = dict(vars(cfg.data.init_args))
    for k in PREPROCESSING:
        if k in accepted and k not in explicit and k in prep:
            args[k] = prep[k]
    if "train_dir" in accepted and not eval_train and "train_dir" not in explicit:
        args.update(_scored_folder(args))
    dm = klass(**args)
    if args.get("packing"):  # images of their own sizes, packed for this model (which no trainer holds here)
        if model is None or not hasattr(model, "forward_packed"):
            p.error("--data.packing packs images for a ViT's forward_packed: evaluate a --checkpoint or --model of a "
                    "ViT (an ONNX file takes one image size)")
        dm.packed_model = model
    if eval_train and hasattr(dm, "eval_transform"):
        dm.train_transform = dm.eval_transform
    dm.setup("test")
    return dm


def _scored_folder(args: dict) -> dict:
    """A classifier's score reads no train split: an image folder without ``train/`` is scored from its ``val/`` (or
    ``test/``) alone, or, with neither, as the class folders themselves (``root/<class>/<images>``). A backbone's
    k-NN and probe fit on ``train/`` and keep the folder's own layout."""
    root = Path(args["root"]).expanduser()
    train, val, test = args.get("train_dir", "train"), args.get("val_dir", "val"), args.get("test_dir", "test")
    if not root.is_dir() or (root / train).is_dir():
        return {}
    if (root / val).is_dir():
        return {"train_dir": val}
    if test and (root / test).is_dir():
        return {"train_dir": test, "val_dir": test}
    return {"train_dir": ".", "val_dir": ".", "test_dir": None}


def _refuse_segmentation_flags(cfg) -> None:
    if cfg.mode != "resized" or cfg.stride is not None:
        raise ValueError("--mode and --stride score a segmentation checkpoint (vitkit.lit.Segmenter); "
                         f"{cfg.checkpoint or cfg.model or cfg.onnx} is not one")


def _stride(stride: int | list[int] | None) -> tuple[int, int] | None:
    """``--stride N`` or ``[H, W]`` as (H, W)."""
    if stride is None:
        return None
    stride = [stride] if isinstance(stride, int) else stride
    if len(stride) not in (1, 2):
        raise ValueError(f"--stride takes one number or [H, W], got {stride}")
    return (stride[0], stride[-1])


def _split(dm, split: str | None) -> tuple[str, Any]:
    test = getattr(dm, "test_set", None)
    if split is None:
        return ("test", test) if test is not None else ("val", dm.val_set)
    if split == "test" and test is None:
        raise ValueError(f"{dm.describe()} has no test split; give --split val")
    if split not in ("test", "val", "train"):
        raise ValueError(f"--split {split!r}: expected test, val or train")
    return split, {"test": test, "val": dm.val_set, "train": getattr(dm, "train_set", None)}[split]




def _evaluate_segmentation(p: ArgumentParser, cfg, explicit: set[str], device: torch.device) -> int:
    """A ``vitkit.lit.Segmenter`` checkpoint, or its ONNX export, over a split of a folder of images and masks: mIoU,
    pixel accuracy, IoU per class, the confusion matrix and the worst images (``vitkit.evaluation.segmentation``)."""
    from vitkit.evaluation.segmentation import MODES, evaluate_masks, segment_logits, write_segmentation_report
    from vitkit.lit import Segmenter

    if cfg.mode not in ("resized", *MODES):
        raise ValueError(f"--mode must be resized, whole or slide, got {cfg.mode!r}")
    if cfg.onnx:  # the export's own preprocessing and class names (its metadata); run in onnxruntime
        onnx = _onnx(cfg.onnx)
        (_, h, w), names, ignore_index = onnx.meta["input_size"], list(onnx.labels or []), None
        mean, std = tuple(onnx.meta["mean"]), tuple(onnx.meta["std"])
        model = lambda x: torch.from_numpy(onnx(x.float().cpu().numpy()))  # noqa: E731
        if cfg.precision != "32-true":
            p.error("--precision applies to a checkpoint; an ONNX file runs as it was exported")
    else:
        module = Segmenter.load_from_checkpoint(cfg.checkpoint, map_location="cpu").eval().to(device)
        net, hp = module.evaluated(), module.hparams  # the run's model: its EMA where that is what it validated
        names, ignore_index = list(hp.class_names or [str(i) for i in range(net.num_classes)]), hp.ignore_index
        (h, w), mean, std = pair(net.backbone.cfg.img_size), tuple(net.backbone.cfg.mean), tuple(net.backbone.cfg.std)
        model = module if cfg.precision == "32-true" else _Autocast(module, device)
    prep = {"img_size": h if h == w else (h, w), "mean": mean, "std": std}
    init = cfg.data.init_args
    for key, value in (("ignore_index", ignore_index), ("classes", names)):
        if key not in explicit and key in init and value is not None:
            init[key] = value
    dm = _data(p, cfg, prep, explicit, False)  # SegmentationDataModule takes img_size, mean and std of these
    if dm.num_classes != len(names):
        raise ValueError(f"the model has {len(names)} classes and the data {dm.num_classes}: evaluate it on "
                         "masks of its own classes")
    split, ds = _split(dm, cfg.split)
    if cfg.mode != "resized":  # each image and mask as they are, one at a time
        stride = _stride(cfg.stride)
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
