"""The ``vitkit`` command: train, recipes, predict, export, prepare-data, download, models, bench, convert, plots.

    vitkit train fit --config vit_tiny_digits                      # a recipe by name (= python train.py fit ...)
    vitkit recipes                                                 # the recipes that ship with vitkit
    vitkit predict cat.jpg dog.png --checkpoint runs/.../best.ckpt --topk 3
    vitkit predict cat.jpg --model vit_base_patch16_224.augreg2_in21k_ft_in1k   # pretrained, by timm's tag
    vitkit download vit_base_patch16_224.augreg2_in21k_ft_in1k Swin_T_Weights.IMAGENET1K_V1
    vitkit models 'swin*'
    vitkit prepare-data ~/data/imagenet ~/data/imagenet-shards   # ImageNet folders -> litdata shards
    vitkit bench --models vit_base_patch16_224 --peers timm       # throughput beside timm (vitkit/tools/bench.py)
    vitkit convert vit_b_16.pth export/ --model vit_base_patch16_224
    vitkit export runs/.../best.ckpt -o model.onnx                # ONNX, checked in onnxruntime
    vitkit predict cat.jpg --onnx model.onnx
    vitkit attention-map cat.jpg --checkpoint best.ckpt -o attention.png
    vitkit reconstruct img.png --checkpoint runs/mae_vit_tiny_digits/checkpoints/last.ckpt -o grid.png
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from . import commands

TOKEN_MERGING = ("ToMe: merge R token pairs in every block (ViT/DeiT; Bolya et al., 2023), faster at some cost in "
                 "accuracy; 0: off")
OVERRIDES = "config fields as JSON, for files that do not record them, e.g. '{\"depth\": 6, \"img_size\": 384}'"


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; bad input ends it with one ``error:`` line and exit status 1 (``vitkit/errors.py``)."""
    from .errors import one_line, take_traceback_flag, take_verbose_flag, user_error, wants_traceback

    from_shell = argv is None
    argv = take_verbose_flag(take_traceback_flag(list(sys.argv[1:] if argv is None else argv)))
    try:
        return _run(argv, from_shell)
    except Exception as e:
        cause = user_error(e)
        if cause is None or wants_traceback():
            raise
        print(one_line(cause), file=sys.stderr)
        return 1


def _run(argv: list[str], from_shell: bool) -> int:
    if argv[:1] == ["train"]:  # everything after `train` belongs to LightningCLI
        from vitkit.lit.lightning_cli import cli_main

        # sys.argv stays as typed (this script, then `train ...`): Lightning starts the other processes of a
        # multi-device run by running that same command line again. LightningCLI then warns that it was given
        # both; that is the point here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            cli_main(argv[1:], prog=f"{Path(sys.argv[0]).name} train" if from_shell else "vitkit train")
        return 0
    if argv[:1] == ["bench"]:
        return commands.bench(argv[1:])
    if argv[:1] == ["evaluate"]:  # its data arguments are the training command's (--data CLASS, --data.root DIR)
        from vitkit.lit.evaluate import main as evaluate

        return evaluate(argv[1:])
    args = parser().parse_args(argv)
    return args.fn(args)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one ``error:`` line and exit status 1, as the other errors of vitkit."""

    def error(self, message: str):
        self.exit(1, f"error: {message} (`{self.prog} --help` lists the options)\n")


def parser() -> argparse.ArgumentParser:
    """The ``vitkit`` command's parser (``train`` and ``bench`` pass their arguments on as they are)."""
    p = OneLineParser(prog="vitkit", description=__doc__.split("\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--traceback", action="store_true", help="show the traceback of an error instead of its one line "
                                                             "(or set VITKIT_TRACEBACK=1)")
    p.add_argument("--verbose", action="store_true", help="show vitkit's DEBUG log: the paths of skipped unreadable "
                                                           "files, the attention path each kind of call runs")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    sub.add_parser("train", help="LightningCLI, the same as `python train.py ...`")
    sub.add_parser("bench", help="img/s, GMACs, MFU and memory beside timm and torchvision (see `vitkit bench --help`)")
    _model_commands(sub)
    _data_and_plot_commands(sub)
    return p


def _model_commands(sub) -> None:
    """predict, export, download, models."""
    sub.add_parser("evaluate", help="scores, per-class metrics, confusion matrix, mistakes and calibration of a "
                                    "classifier on a data split; k-NN / linear probe of a backbone", add_help=False)
    s = sub.add_parser("predict", help="top-k classes for image files")
    s.add_argument("images", nargs="+")
    s.add_argument("--checkpoint", help="any format vitkit reads (a .ckpt keeps the class names)")
    s.add_argument("--model", help="without --checkpoint: pretrained weights by name (a timm tag or torchvision "
                                   "weights); with it: the preset, for formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--topk", type=int, default=5)
    s.add_argument("--onnx", help="an exported model.onnx, run by onnxruntime with the preprocessing in its metadata")
    s.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    s.set_defaults(fn=commands.predict)
    s = sub.add_parser("export", help="a model or checkpoint -> ONNX (checked in onnxruntime) or torch.export .pt2")
    s.add_argument("src", help="a checkpoint in any format vitkit reads, a preset name, or a timm tag")
    s.add_argument("-o", "--output", help="output file (default: <model>.onnx or <model>.pt2)")
    s.add_argument("--format", choices=["onnx", "torch-export"], default="onnx")
    s.add_argument("--model", help="the preset, for checkpoint formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--img-size", type=int, nargs="+", help="export at this size (H [W]); positions and windows are "
                                                           "resized as on load")
    s.add_argument("--fixed-size", action="store_true", help="export height and width fixed (default: dynamic)")
    s.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    s.add_argument("--opset", type=int, default=18, help="ONNX opset, 18 or newer")
    s.add_argument("--atol", type=float, default=1e-4, help="largest difference to PyTorch the check accepts")
    s.set_defaults(fn=commands.export)
    s = sub.add_parser("download", help="fetch pretrained weights by name into their cache, for offline use")
    s.add_argument("names", nargs="+", help="timm tags (vit_small_patch16_224.augreg_in21k_ft_in1k, or any timm "
                                            "model's, as a teacher's: regnety_160.deit_in1k), torchvision weights "
                                            "(Swin_T_Weights.IMAGENET1K_V1) or hf-hub:REPO; with --dataset, "
                                            "Hugging Face dataset names")
    s.add_argument("--dataset", action="store_true", help="the names are datasets (beans, timm/mini-imagenet), "
                                                          "fetched into HF_DATASETS_CACHE for --data.name")
    s.add_argument("--config-name", default=None, help="with --dataset: the dataset's configuration")
    s.add_argument("--revision", default=None, help="with --dataset: a branch, tag or commit")
    s.set_defaults(fn=commands.download)
    s = sub.add_parser("models", help="table of presets: params, GMACs, image size, family")
    s.add_argument("pattern", nargs="?", default="*")
    s.add_argument("--no-flops", action="store_true", help="skip counting GMACs")
    s.set_defaults(fn=commands.models)


def _data_and_plot_commands(sub) -> None:
    """recipes, prepare-data, convert, attention-map, reconstruct, pos-embed."""
    s = sub.add_parser("recipes", help="the training recipes that ship with vitkit, one line each")
    s.set_defaults(fn=commands.recipes)
    s = sub.add_parser("prepare-data", help="ImageNet-layout folders -> litdata shards for StreamingImageDataModule")
    s.add_argument("root", help="a folder with train/<class>/<images>, val/<class>/<images> and optionally test/")
    s.add_argument("out", help="the output folder; run again on it to resume an interrupted conversion")
    s.add_argument("--workers", type=int, default=None, help="parallel workers (default: every CPU)")
    s.add_argument("--chunk-bytes", default="64MB", help="size of a shard file (default: 64MB)")
    s.add_argument("--overwrite", action="store_true", help="delete OUT and convert from the start")
    s.add_argument("--seed", type=int, default=0, help="seed of the random order each split is written in (default: 0)")
    s.set_defaults(fn=commands.prepare_data)
    s = sub.add_parser("convert", help="any checkpoint format -> vitkit/timm folder or state-dict file")
    s.add_argument("src", help="any format vitkit reads, a sharded (FSDP2) checkpoint folder included")
    s.add_argument("dst", nargs="?", help="a folder (model.safetensors + config.json), or a .safetensors / .pth / "
                   ".bin file")
    s.add_argument("-o", "--output", help="the destination, as DST")
    s.add_argument("--model", help="preset name, for formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--adapter", action="store_true", help="a LoRA run's checkpoint -> peft's adapter folder "
                   "(adapter_config.json, adapter_model.safetensors), not merged into the backbone")
    s.set_defaults(fn=commands.convert)
    s = sub.add_parser("attention-map", help="attention over an image: rollout (ViT) or per-window (Swin)")
    s.add_argument("image")
    s.add_argument("--checkpoint", help="any format vitkit reads; without it, --model names pretrained weights")
    s.add_argument("--model")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("-o", "--output", default="attention.png")
    s.add_argument("--stage", type=int, default=0, help="Swin: which stage")
    s.add_argument("--block", type=int, default=1, help="Swin: which block (1 = the first shifted one)")
    s.set_defaults(fn=commands.attention_map)
    s = sub.add_parser("reconstruct", help="a pre-training checkpoint's original / masked / reconstruction grid")
    s.add_argument("images", nargs="+")
    s.add_argument("--checkpoint", required=True, help="a pre-training run's checkpoint, Meta's mae_visualize_* file "
                                                       "or a transformers ViTMAE / MaskedImageModeling folder")
    s.add_argument("--model", help="the encoder preset, for files that do not record it")
    s.add_argument("--objective", choices=["mae", "simmim"], help="for files that do not record it")
    s.add_argument("--mask-ratio", type=float, help="hide this fraction (default: the checkpoint's)")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--seed", type=int, default=0, help="seed of the mask")
    s.add_argument("-o", "--output", default="reconstruction.png")
    s.set_defaults(fn=commands.reconstruct)
    s = sub.add_parser("pos-embed", help="similarity of learned position embeddings, beside fixed 2-D sin-cos")
    s.add_argument("--checkpoint", help="any format vitkit reads; without it, --model names pretrained weights")
    s.add_argument("--model")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("-o", "--output", default="pos_embed.png")
    s.set_defaults(fn=commands.pos_embed)


if __name__ == "__main__":
    sys.exit(main())
