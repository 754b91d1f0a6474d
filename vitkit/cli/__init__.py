"""The ``vitkit`` command. Each subcommand is a module of this package with its parser and its ``main(argv)``;
:data:`COMMANDS` lists them, and ``vitkit --help``, the docs' command reference and the tests all read it.

    vitkit train fit --config vit_tiny_digits                      # a recipe by name (= python train.py fit ...)
    vitkit recipes                                                 # the recipes that ship with vitkit
    vitkit predict cat.jpg dog.png --checkpoint runs/.../best.ckpt --topk 3
    vitkit predict cat.jpg --model vit_base_patch16_224.augreg2_in21k_ft_in1k   # pretrained, by timm's tag
    vitkit evaluate --checkpoint best.ckpt --data.root DATA -o report/
    vitkit download vit_base_patch16_224.augreg2_in21k_ft_in1k Swin_T_Weights.IMAGENET1K_V1
    vitkit models 'swin*'
    vitkit prepare-data ~/data/imagenet ~/data/imagenet-shards   # ImageNet folders -> litdata shards
    vitkit bench --models vit_base_patch16_224 --peers timm       # throughput beside timm
    vitkit convert vit_b_16.pth export/ --model vit_base_patch16_224
    vitkit export runs/.../best.ckpt -o model.onnx                # ONNX, checked in onnxruntime
    vitkit predict cat.jpg --onnx model.onnx
    vitkit serve model.onnx --port 8000                          # POST /predict, a page at /, /health, /metrics
    vitkit attention-map cat.jpg --checkpoint best.ckpt -o attention.png
    vitkit reconstruct img.png --checkpoint runs/mae_vit_tiny_digits/checkpoints/last.ckpt -o grid.png

Every subcommand ends bad input with one ``error: ...`` line and exit status 1 (``--traceback``, or
``VITKIT_TRACEBACK=1``, shows the traceback instead; ``vitkit/errors.py``). Each imports torch and the rest of vitkit
only when it runs, so that ``vitkit --help`` and ``vitkit recipes`` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from types import ModuleType

# name -> one line of help; the module is vitkit.cli.<name with "_" for "-">
COMMANDS: dict[str, str] = {
    "train": "fit, validate, test or predict with LightningCLI (the same as `python train.py ...`)",
    "evaluate": "scores, per-class metrics, confusion matrix, mistakes and calibration of a classifier on a data "
                "split (a segmenter's mIoU, a detector's COCO AP, a depth model's errors); k-NN / linear probe of a "
                "backbone",
    "predict": "top-k classes for image files (a segmenter: a mask and an overlay; a detector: boxes drawn and COCO "
               "JSON; a depth model: a coloured and a 16-bit map)",
    "export": "a model or checkpoint -> ONNX (checked in onnxruntime) or torch.export .pt2",
    "serve": "a model file behind an HTTP endpoint (LitServe): POST /predict, a page to try it, /health, /metrics",
    "download": "fetch pretrained weights (or Hugging Face datasets) by name into their cache, for offline use",
    "models": "table of presets: params, GMACs, image size, family",
    "bench": "img/s, GMACs, MFU and memory beside timm and torchvision",
    "recipes": "the training recipes that ship with vitkit, one line each",
    "prepare-data": "ImageNet-layout folders -> litdata shards for StreamingImageDataModule",
    "convert": "any checkpoint format -> vitkit/timm folder, state-dict file or peft adapter folder",
    "attention-map": "attention over an image: rollout (ViT) or per-window (Swin)",
    "reconstruct": "a pre-training checkpoint's original / masked / reconstruction grid",
    "pos-embed": "similarity of learned position embeddings, beside fixed 2-D sin-cos",
}


def command(name: str) -> ModuleType:
    """The module of subcommand ``name`` (``prepare-data`` -> ``vitkit.cli.prepare_data``)."""
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")


def parser() -> argparse.ArgumentParser:
    """The top-level parser: the options every subcommand takes and the list of subcommands (each parses its own
    arguments: ``vitkit NAME --help``)."""
    from .common import OneLineParser

    p = OneLineParser(prog="vitkit", description="Vision transformers: train, evaluate, predict, export, benchmark.",
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--traceback", action="store_true", help="show the traceback of an error instead of its one line "
                                                             "(or set VITKIT_TRACEBACK=1)")
    p.add_argument("--verbose", action="store_true", help="show vitkit's DEBUG log: the paths of skipped unreadable "
                                                           "files, the attention path each kind of call runs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a subcommand; bad input ends it with one ``error:`` line and exit status 1. ``prog`` names a program that
    runs ``vitkit train`` (``python train.py``), whose arguments ``argv`` then are."""
    from vitkit.errors import take_traceback_flag, take_verbose_flag

    from .help_cache import asks_for_help, show

    argv = take_verbose_flag(take_traceback_flag(list(sys.argv[1:] if argv is None else argv)))
    if prog is not None:
        return guarded(lambda: command("train").main(argv, prog=prog))
    if asks_for_help(argv):  # train's and evaluate's need Lightning: shown from the cache after the first time
        return guarded(lambda: show(argv, lambda: command(argv[0]).main(argv[1:])))
    if argv and argv[0] in COMMANDS:
        return guarded(lambda: command(argv[0]).main(argv[1:]))
    return guarded(lambda: parser().parse_args(argv) and 1)  # --help, or an error naming the subcommands


def guarded(run: Callable[[], int]) -> int:
    """``run()`` with other libraries' routine lines hidden (``vitkit/library_output.py``); an error about the user's
    input ends it with its one ``error:`` line on stderr and status 1. The one place where a command's error is said."""
    from vitkit.errors import error_line
    from vitkit.library_output import quiet

    try:
        with quiet():
            return run()
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
