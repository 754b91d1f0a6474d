"""``vitkit export``: a preset, a tag or any checkpoint -> ONNX (checked in onnxruntime) or a torch.export program."""

from __future__ import annotations

import sys
from pathlib import Path

from vitkit.errors import UsageError

from .common import OVERRIDES, TOKEN_MERGING, command_parser, parse_overrides


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
    p.add_argument("--packed", action="store_true", help="a ViT classifier on packed batches: images of their own "
                   "sizes in sequences, the sequence count and length and the image count dynamic (inputs patches, "
                   "image, index, grids; vitkit/deploy/export_packed.py)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, 18 or newer")
    p.add_argument("--atol", type=float, default=1e-4, help="largest difference to PyTorch the check accepts")
    q = p.add_argument_group("int8 (vitkit/deploy/quantize.py; SRC may also be an fp32 .onnx written by vitkit export)")
    q.add_argument("--int8", nargs="?", const="static", choices=("static", "dynamic"), default=None,
                   help="quantize the linear layers to int8: static (calibrated activation ranges, the default) or "
                   "dynamic (ONNX only); softmax, LayerNorm and the attention's products stay in float. With "
                   "--format torch-export, PyTorch's x86 quantizer (torchao) writes a .pt2 that runs fast compiled")
    q.add_argument("--calibrate", metavar="DIR", help="labelled images: a classifier's, one folder per class named "
                   "as the model's labels (DIR/val/<class> where there is one); a detector's, a COCO, YOLO or VOC "
                   "folder (its val split where there is one). The first --calibration-size calibrate, the rest "
                   "(100 or more) score fp32 against int8")
    q.add_argument("--calibration-size", type=int, default=200, metavar="N", help="images to calibrate on (200)")
    q.add_argument("--calibration-method", choices=("minmax", "entropy", "percentile"), default="minmax",
                   help="how activation ranges are read from the calibration images (minmax)")
    q.add_argument("--max-drop", type=float, default=None, metavar="POINTS", help="refuse to write when int8 loses "
                   "more points than this on the held-out images: of top-1 for a classifier (0.5), of COCO's "
                   "AP50:95 for a detector (1); for a depth model, when its AbsRel is more than this percent worse "
                   "(5)")
    q.add_argument("--keep-fp32", nargs="+", default=(), metavar="PATTERN", help="layers to keep in float, by "
                   "module name (fnmatch: '*blocks.11.*', '*.fc2', 'head.*'; a refusal names the model's own)")
    return p


def _check_int8(args) -> None:
    if args.int8 is None:
        if args.calibrate or args.keep_fp32:
            raise UsageError("--calibrate and --keep-fp32 go with --int8")
        return
    if args.format != "onnx" and args.int8 == "dynamic":
        raise UsageError("--int8 dynamic writes an ONNX file (onnxruntime's dynamic int8 operators); --format "
                         f"{args.format} takes static int8 (PyTorch's x86 quantizer)")
    if args.format != "onnx" and args.src.endswith(".onnx"):
        raise UsageError(f"--format {args.format} --int8 quantizes the model itself: give its checkpoint, weights or "
                         f"name, not the ONNX file {args.src}")
    if not args.calibrate:
        raise UsageError("--int8 needs --calibrate DIR: labelled images to calibrate on and to score fp32 against "
                         "int8 before the file is written")
    if args.calibration_size < 1 or (args.max_drop is not None and args.max_drop < 0):
        raise UsageError(f"--calibration-size takes 1 or more and --max-drop 0 or more, got {args.calibration_size} "
                         f"and {args.max_drop}")


def int8_gate(fp32: str):
    """The int8 gate of the task of the export ``fp32`` (its ``vitkit.task`` metadata), or one line where the task
    names none."""
    from vitkit.deploy.onnx_model import OnnxModel
    from vitkit.tasks import registry

    task = registry.for_onnx(OnnxModel(fp32).meta)
    if task.int8_gate is None:
        gated = ", ".join(t.name for t in registry.tasks().values() if t.int8_gate)
        raise UsageError(f"{fp32} is a {task.name} model, and int8 export scores int8 against fp32 on labelled "
                         f"images for the tasks that say how ({gated}); keep this one in fp32")
    return task.function("int8_gate")


def _int8(args, fp32: str, out: str) -> int:
    from vitkit.deploy.quantize import QuantizationRefused, quantize_int8

    try:
        report = quantize_int8(fp32, out, args.calibrate, mode=args.int8, calibration=args.calibration_size,
                               max_drop=args.max_drop, keep=tuple(args.keep_fp32), method=args.calibration_method,
                               gate=int8_gate(fp32))
    except QuantizationRefused as e:
        raise UsageError(f"{e}") from None
    print(report)
    return 0


def _int8_program(args, net, out: str) -> int:
    from vitkit.deploy.export import ExportError
    from vitkit.deploy.quantize import QuantizationRefused
    from vitkit.deploy.quantize_program import quantize_program

    try:
        report = quantize_program(net, out, args.calibrate, calibration=args.calibration_size,
                                  max_drop=0.5 if args.max_drop is None else args.max_drop,
                                  keep=tuple(args.keep_fp32))
    except (QuantizationRefused, ExportError) as e:
        raise UsageError(f"{e}") from None
    print(report)
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    _check_int8(args)
    if args.packed and (args.int8 or args.fixed_size or args.token_merging):
        raise UsageError("--packed exports the float model for images of any size: without " +
                         ("--int8" if args.int8 else "--fixed-size" if args.fixed_size else "--token-merging"))
    if args.int8 and args.src.endswith(".onnx"):  # an fp32 export already written
        if not Path(args.src).is_file():
            raise UsageError(f"{args.src} does not exist")
        return _int8(args, args.src, args.output or f"{Path(args.src).stem}.int8.onnx")
    from vitkit.deploy.export import ExportError, export_onnx, export_program

    if args.output:  # before the model is built: a folder on the way that is a file
        parent = Path(args.output).parent
        blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"-o {args.output}: {blocking} is a file, not a folder")
    overrides = parse_overrides(args.overrides)
    if args.img_size:
        overrides["img_size"] = args.img_size[0] if len(args.img_size) == 1 else tuple(args.img_size)
    if args.token_merging:
        overrides["token_merging"] = args.token_merging
    if Path(args.src).exists():  # a model file: its task gives the model to export
        import vitkit.lit  # noqa: F401 - the class paths checkpoints record (Lightning loads only imported classes)
        from vitkit.tasks import registry

        if args.model:
            overrides["model"] = args.model
        net = registry.for_file(args.src, "export_model").function("export_model")(args.src, overrides)
    else:
        net = _named_model(args, overrides)
    out = args.output or f"{net.name}{'.int8' if args.int8 else ''}.{'onnx' if args.format == 'onnx' else 'pt2'}"
    from vitkit.deploy.quantize import int8_fixed_size

    dynamic = False if args.fixed_size or (args.int8 and int8_fixed_size(net)) else None
    if args.packed:
        return _packed(args, net, out)
    if args.int8 and args.format != "onnx":
        return _int8_program(args, net, out)
    fp32 = str(Path(out).with_name(Path(out).name + ".fp32.tmp")) if args.int8 else out
    try:
        if args.format == "onnx":
            report = export_onnx(net, fp32, dynamic_size=dynamic, opset=args.opset, atol=args.atol)
        else:
            report = export_program(net, out, dynamic_size=dynamic, atol=args.atol)
    except ExportError as e:
        raise UsageError(f"{e}") from None
    except ImportError as e:
        raise UsageError(f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); "
                         "pip install 'vitkit[export]'") from None
    if args.int8:
        print(f"the fp32 export: max |diff| against PyTorch {report.max_abs_diff:.2e}")
        try:
            return _int8(args, fp32, out)
        finally:
            Path(fp32).unlink(missing_ok=True)
    print(report)
    return 0


def _packed(args, net, out: str) -> int:
    from vitkit.deploy.export import ExportError
    from vitkit.deploy.export_packed import export_packed

    try:
        print(export_packed(net, out, fmt=args.format, opset=args.opset, atol=args.atol))
    except ExportError as e:
        raise UsageError(f"{e}") from None
    except ImportError as e:
        raise UsageError(f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); "
                         "pip install 'vitkit[export]'") from None
    return 0


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
        from vitkit.tasks.classification.inference import require_classifier

        require_classifier(net, name)
    else:
        print(f"{name}: no weights given, so the export holds a random initialisation (give a checkpoint file "
              "or a tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k for trained weights)", file=sys.stderr)
    return net
