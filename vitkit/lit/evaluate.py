"""``vitkit evaluate``: a classifier (a checkpoint, a tag or an ONNX file) over a split of any data module, into a
folder of scores and pictures (``vitkit/tools/evaluate.py``); a backbone by k-NN and a linear probe on its features.

The data comes by the training command's ``--data`` arguments (``--data.root DIR`` alone means an image folder);
the data module's preprocessing defaults to the model's own (its size, mean, std, crop and interpolation).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import ArgumentParser
from torch import Tensor

from vitkit.tools.evaluate import (
    Predictions,
    knn_top1,
    linear_probe_top1,
    summary,
    write_backbone_report,
    write_report,
)

from .report import display_stats

PREPROCESSING = ("img_size", "mean", "std", "crop_pct", "interpolation")
PRECISIONS = ("32-true", "bf16-mixed")


def _autocast(model, device: torch.device):
    """``model`` (and its ``features``) under bf16 autocast, as Lightning's bf16-mixed runs validation."""
    def run(fn):
        def wrapped(x):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return fn(x)
        return wrapped

    out = run(model)
    if hasattr(model, "features"):
        out.features = run(model.features)
    if hasattr(model, "cfg"):
        out.cfg = model.cfg
    return out


def parser() -> ArgumentParser:
    from .lightning_cli import OneLineParser

    p = OneLineParser(prog="vitkit evaluate", description="Score a classifier on a split of a data module: "
                       "metrics.json, predictions.csv and pictures into --out; or a backbone by --knn / "
                       "--linear-probe. The data: --data.root DIR (an image folder), or --data CLASS with its "
                       "arguments, as for `vitkit train`.")
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
    p.add_argument("--device", type=str, default="auto")
    p.add_argument("--precision", type=str, default="32-true", help="32-true, or bf16-mixed (bf16 autocast: what a "
                   "run trained with --trainer.precision bf16-mixed validated with; float32 scores differ slightly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_subclass_arguments(L.LightningDataModule, "data", required=False, fail_untyped=False)
    return p


def _argv(argv: list[str]) -> list[str]:
    """``--data.root DIR`` without ``--data CLASS`` is an image folder (and a bare ``--flag`` is ``--flag true``)."""
    named = any(a == "--data" or a.startswith("--data=") for a in argv)
    if not named and any(a.startswith("--data.") for a in argv):
        argv = ["--data", "vitkit.lit.ImageFolderDataModule", *argv]
    flags = ("--knn", "--linear-probe")
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a in flags and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("true")
    return out


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
    size = cfg.data.init_args.get("img_size") if "img_size" in explicit else None
    model, names, prep = _model(cfg, device, size)
    if cfg.precision == "bf16-mixed":
        model = _autocast(model, device)
    backbone = cfg.knn or cfg.linear_probe
    if not backbone and names is None:
        raise ValueError(f"{cfg.checkpoint or cfg.model} has no classifier head (a backbone): score its features "
                         "with --knn or --linear-probe, or fine-tune it first")
    dm = _data(p, cfg, prep, explicit, eval_train=backbone)
    names = names or getattr(dm, "classes", None)
    split, ds = _split(dm, cfg.split)
    out = Path(cfg.out)
    if backbone:
        result = _backbone(model, dm, ds, cfg, device)
        write_backbone_report(result, out)
        print(", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.endswith("_top1")) + f"  -> {out}")
        return 0
    if len(names) != _width(model, dm, ds, device):
        raise ValueError(f"the model has {_width(model, dm, ds, device)} classes and the data "
                         f"{len(getattr(dm, 'classes', names))}: evaluate it on data of its own classes")
    pred = predict(model, dm, ds, device)
    skipped = sum(getattr(dm, "skipped", {}).values())  # unreadable images, counted by the data module
    result = write_report(pred, names, out, cfg.topk, {"skipped": skipped, "split": split})
    print(f"{dm.describe()} ({split}):\n{summary(result)}\n-> {out}")
    return 0


def _model(cfg, device: torch.device, img_size: int | None = None) -> tuple[Any, list[str] | None, dict]:
    """(a callable from a batch to logits or features, the class names or None for a backbone, the model's
    preprocessing for the data module); ``img_size``: the size given for the data, the model's too (positions and
    windows resized on load)."""
    if cfg.onnx:
        from vitkit.tools.export import OnnxModel

        net = OnnxModel(cfg.onnx)
        if not net.labels:
            raise ValueError(f"{cfg.onnx} records no class names (no vitkit.labels metadata): export it from a "
                             "checkpoint that has them (`vitkit export CKPT`), or evaluate the checkpoint itself")
        c, h, w = net.meta["input_size"]
        prep = {"img_size": h, **{k: net.meta[k] for k in ("mean", "std", "crop_pct", "interpolation")}}
        return (lambda x: torch.from_numpy(net(x.float().cpu().numpy()))), list(net.labels), prep
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
    size = net.cfg.img_size if isinstance(net.cfg.img_size, int) else net.cfg.img_size[0]
    prep = {"img_size": size, "mean": tuple(net.cfg.mean), "std": tuple(net.cfg.std),
            "crop_pct": net.cfg.crop_pct, "interpolation": net.cfg.interpolation}
    net.features = lambda x: net.forward_head(net.forward_features(x), pre_logits=True)
    return net, names, prep


def _data(p: ArgumentParser, cfg, prep: dict, explicit: set[str], eval_train: bool) -> L.LightningDataModule:
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
        if k in accepted and k not in explicit:
            args[k] = prep[k]
    dm = klass(**args)
    if eval_train and hasattr(dm, "train_transform"):
        from vitkit.data.transforms import eval_transform

        dm.train_transform = lambda: eval_transform(dm.data_cfg)
    dm.setup("test")
    return dm


def _split(dm, split: str | None) -> tuple[str, Any]:
    test = getattr(dm, "test_set", None)
    if split is None:
        return ("test", test) if test is not None else ("val", dm.val_set)
    if split == "test" and test is None:
        raise ValueError(f"{dm.describe()} has no test split; give --split val")
    if split not in ("test", "val", "train"):
        raise ValueError(f"--split {split!r}: expected test, val or train")
    return split, {"test": test, "val": dm.val_set, "train": getattr(dm, "train_set", None)}[split]


def _batches(dm, ds, device: torch.device):
    """(x on the device, y, the rows' sources) of each batch that has an image; unreadable images are skipped."""
    from rich.progress import track

    loader = dm._loader(ds, False)
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


def _width(model, dm, ds, device: torch.device) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        return cfg.num_classes
    x, _, _ = next(_batches(dm, ds, device))
    with torch.no_grad():
        return model(x[:1]).shape[-1]


@torch.no_grad()
def predict(model, dm, ds, device: torch.device) -> Predictions:
    """Softmax probabilities, labels and sources of every readable image of ``ds``; the most confident mistakes."""
    mean, std = display_stats(dm)
    probs, labels, sources = [], [], []
    pred = Predictions(torch.empty(0), torch.empty(0, dtype=torch.long), [])
    for x, y, src in _batches(dm, ds, device):
        p = model(x).float().softmax(-1).cpu()
        probs.append(p)
        labels.append(y.cpu())
        sources += src
        pred.keep_mistakes((x.float().cpu() * std + mean).clamp(0, 1), p, y.cpu())
    pred.probs, pred.labels, pred.sources = torch.cat(probs), torch.cat(labels), sources
    return pred


@torch.no_grad()
def features(model, dm, ds, device: torch.device) -> tuple[Tensor, Tensor]:
    feats, labels = [], []
    for x, y, _ in _batches(dm, ds, device):
        feats.append(model.features(x).float().cpu())
        labels.append(y.cpu())
    return torch.cat(feats), torch.cat(labels)


def _backbone(model, dm, ds, cfg, device: torch.device) -> dict:
    if not hasattr(model, "features"):
        raise ValueError("--knn and --linear-probe need a PyTorch model (--checkpoint or --model), not --onnx")
    train, train_y = features(model, dm, dm.train_set, device)
    val, val_y = features(model, dm, ds, device)
    result: dict = {"train_samples": len(train_y), "samples": len(val_y), "feature_dim": train.shape[1]}
    if cfg.knn:
        result["knn_top1"] = knn_top1(train, train_y, val, val_y, cfg.k, cfg.temperature)
        result.update(k=cfg.k, temperature=cfg.temperature)
    if cfg.linear_probe:
        result["linear_probe_top1"] = linear_probe_top1(train, train_y, val, val_y)
    return result

