"""``vitkit evaluate``: a model (a checkpoint, a tag or an ONNX file) over a split of any data module, into a folder of
scores and pictures, by its task's evaluator (``vitkit.tasks``: a classifier's top-k, calibration and mistakes, a
multi-label model's mAP, a segmenter's mIoU, a detector's COCO AP, a depth model's AbsRel and δ1); a backbone by
k-NN and a linear probe on its features.

The data comes by the training command's ``--data`` arguments (``--data.root DIR`` alone means the task's own data
module: an image folder for a classifier, images and masks for a segmenter, images with boxes or depth maps for a
detector or a depth model); the data module's preprocessing
defaults to the model's own (its size, mean, std, crop and interpolation).
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import torch
from jsonargparse import ArgumentParser

from vitkit.evaluation.setup import PRECISIONS


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
    """``--data.root DIR`` without ``--data CLASS`` is the task's own data module (an image folder, or for a
    segmenter a folder of images and masks), and a bare ``--flag`` is ``--flag true``."""
    if not any(a == "--data" or a.startswith("--data=") for a in argv) and any(a.startswith("--data.") for a in argv):
        from vitkit.tasks import registry

        argv = ["--data", _task(argv).data_module or registry.other_files().data_module, *argv]
    flags = ("--knn", "--linear-probe")
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a in flags and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("true")
    return out


def _task(argv: list[str]):
    """The task of the model ``argv`` names (``--checkpoint``, ``--onnx``; a tag, or a backbone scored by its
    features, the classifier's)."""
    from vitkit.tasks import registry

    def value(flag: str) -> str | None:
        for i, a in enumerate(argv):
            if a.startswith(flag + "="):
                return a.partition("=")[2]
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
        return None

    if any(a.split("=")[0] in ("--knn", "--linear-probe") for a in argv):
        return registry.other_files()
    if value("--onnx"):
        try:
            return registry.for_onnx(_onnx(value("--onnx")).meta)
        except Exception:  # noqa: BLE001 - a file that does not load is named where the model is loaded
            return registry.other_files()
    if value("--checkpoint"):
        return registry.for_file(value("--checkpoint"), "evaluate")
    return registry.other_files()


def _onnx(path: str):
    """The export at ``path`` in onnxruntime, loaded once however often the command asks (a file written again at
    the same path, as a second export in one Python process writes it, is loaded again)."""
    stat = Path(path).stat() if Path(path).is_file() else None
    return _loaded(path, stat and (stat.st_mtime_ns, stat.st_size, stat.st_ino))


@functools.lru_cache(maxsize=4)
def _loaded(path: str, version):
    from vitkit.deploy.onnx_model import OnnxModel

    return OnnxModel(path)


def parse_args(argv: list[str]):
    """The parsed command line (``--data.root DIR`` alone: the task's data module; a bare ``--knn``: true)."""
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
    import vitkit.lit  # noqa: F401 - the class paths checkpoints record (Lightning loads only imported classes)

    task = _task(argv)
    return task.function("evaluate")(cfg, explicit, device, _onnx(cfg.onnx) if cfg.onnx else None)
