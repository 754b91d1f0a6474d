"""``vitkit export``: a preset, a tag or any checkpoint -> ONNX (checked in onnxruntime) or a torch.export program."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vitkit.errors import UsageError

from .common import OVERRIDES, TOKEN_MERGING, command_parser, load_classifier, parse_overrides, require_classifier


def parser():
    p = command_parser("export")
    p.add_argument("src", help="a checkpoint in any format vitkit reads, a preset name, or a timm tag")
    p.add_argument("-o", "--output", help="output file (default: <model>.onnx or <model>.pt2)")
    p.add_argument("--format", choices=["onnx", "torch-export"], default="onnx")
    p.add_argument("--model", help="the preset, for checkpoint formats that do not record it")
    p.add_argument("--overrides", default="{}", help=OVERRIDES)
    p.add_argument("--img-size", type=int, nargs="+", help="export at this size (H [W]); positions and windows are "
                                                           "resized as on load")
    p.add_argument("--fixed-size", action="store_true", help="export height and width fixed (default: dynamic)")
    p.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, 18 or newer")
    p.add_argument("--atol", type=float, default=1e-4, help="largest difference to PyTorch the check accepts")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from vitkit.tools.export import ExportError, export_onnx, export_program

    if args.output:  # before the model is built: a folder on the way that is a file
        parent = Path(args.output).parent
        blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"-o {args.output}: {blocking} is a file, not a folder")
    overrides = parse_overrides(args.overrides)
    if args.img_size:
        overrides["img_size"] = args.img_size[0] if len(args.img_size) == 1 else tuple(args.img_size)
    if args.token_merging and not Path(args.src).exists():
        overrides["token_merging"] = args.token_merging
    from .predict import segmentation_checkpoint

    if Path(args.src).exists() and segmentation_checkpoint(args.src) is not None:
        net = _segmenter(args.src, overrides)
    elif Path(args.src).exists():
        args.checkpoint, args.overrides = args.src, json.dumps(overrides)
        net = load_classifier(args)
    else:
        net = _named_model(args, overrides)
    out = args.output or f"{net.name}.{'onnx' if args.format == 'onnx' else 'pt2'}"
    dynamic = False if args.fixed_size else None
    try:
        if args.format == "onnx":
            report = export_onnx(net, out, dynamic_size=dynamic, opset=args.opset, atol=args.atol)
        else:
            report = export_program(net, out, dynamic_size=dynamic, atol=args.atol)
    except ExportError as e:
        raise UsageError(f"{e}") from None
    except ImportError as e:
        raise UsageError(f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); "
                         "pip install 'vitkit[export]'") from None
    print(report)
    return 0


def _segmenter(path: str, overrides: dict):
    """The segmentation model of a ``vitkit.lit.Segmenter`` checkpoint, with its class names (for the metadata)."""
    from vitkit.lit import Segmenter

    if overrides:
        raise UsageError(f"{path} is a segmentation checkpoint: it exports as it was trained, without --overrides or "
                         "--img-size (a ViT backbone's export takes any size)")
    module = Segmenter.load_from_checkpoint(path, map_location="cpu").eval()
    net = module.evaluated()  # the run's model: its EMA where that is what it validated
    net.class_names = list(module.hparams.class_names or [str(i) for i in range(net.num_classes)])
    return net


def _named_model(args, overrides: dict):
    """A preset (random weights, for trying the export) or pretrained weights by tag."""
    import vitkit
    from vitkit.checkpoints.hub import MissingWeightsError

    name = args.src
    tagged = "." in name or name.startswith("hf-hub:")
    try:
        net = vitkit.create_model(name, pretrained=tagged, **overrides).eval()
    except MissingWeightsError as e:
        raise UsageError(f"{e}") from None
    except ValueError as e:
        if "token_merging" in overrides:
            raise UsageError(f"--token-merging {args.token_merging}: {e}") from None
        raise UsageError(f"{args.src!r} is neither a file nor a model vitkit knows: {e}") from None
    except KeyError as e:
        raise UsageError(f"{args.src!r} is neither a file nor a model vitkit knows: {e}") from None
    if tagged:
        require_classifier(net, name)
    else:
        print(f"{name}: no weights given, so the export holds a random initialisation (give a checkpoint file "
              "or a tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k for trained weights)", file=sys.stderr)
    return net
