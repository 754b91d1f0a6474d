"""``vitkit predict``: what a model says of image files, from a checkpoint, a tag or an exported ONNX file, through
its task's predictor (``vitkit.tasks``): a classifier's top-k classes (a multi-label one's labels above their
thresholds), a segmenter's mask and overlay files, a detector's boxes drawn on the image and listed in COCO's result
format, a depth model's coloured and 16-bit maps."""

from __future__ import annotations

import sys
from pathlib import Path

from vitkit.errors import UsageError, one_line

from .common import TOKEN_MERGING, add_model_source, command_parser, image_paths, parse_overrides


def parser():
    p = command_parser("predict")
    p.add_argument("images", nargs="+", help="image files, or folders of them (every image inside, sorted)")
    add_model_source(p, "any format vitkit reads (a .ckpt keeps the class names), or an int8 .pt2 of vitkit export",
                     "without --checkpoint: pretrained weights by name (a timm tag or torchvision weights); with it: "
                     "the preset, for formats that do not record it")
    p.add_argument("--topk", type=int, default=None, help="the K most probable classes (default 5; a multi-label "
                   "model prints the labels above their thresholds, and these K too when given)")
    p.add_argument("--onnx", help="an exported model.onnx, run by onnxruntime with the preprocessing in its metadata")
    p.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    p.add_argument("--max-patches", type=int, default=None, metavar="N", help="a ViT: each image whole, resized "
                   "within N patches at its own aspect ratio (as --data.packing evaluates), not cropped square; a "
                   "model trained with --data.packing does so by default, at its budget, and so does an ONNX file "
                   "exported with --packed, at its recorded budget unless N is given")
    p.add_argument("--mode", choices=("whole", "slide"), default="whole", help="a segmenter: whole (the image "
                   "resized to the model's size, the logits back to the image's) or slide (windows of the model's "
                   "size over the image as it is, --stride apart, overlapping logits averaged)")
    p.add_argument("--stride", type=int, nargs="+", default=None, metavar="N", help="--mode slide: the windows' step, "
                   "H W or one number (default two thirds of the model's size)")
    p.add_argument("--threshold", type=float, default=None, metavar="S", help="a detector: the least score of the "
                   "boxes drawn and listed (default 0.5)")
    p.add_argument("-o", "--output", default="predictions", help="the folder of the files each image gives "
                   "(default predictions/): a segmenter's NAME_mask.png (class indices, coloured) and "
                   "NAME_overlay.png; a detector's "
                   "NAME_overlay.png and NAME_detections.json (COCO's result format); a depth model's "
                   "NAME_depth.png (coloured), NAME_depth16.png and NAME_depth.npy (float32)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.images = image_paths(args.images)
    if args.topk is not None and args.topk < 1:
        raise UsageError(f"--topk expects a whole number of classes of 1 or more, got {args.topk}")
    if args.stride is not None and (len(args.stride) > 2 or min(args.stride) < 1):
        raise UsageError(f"--stride takes H W or one number, each 1 or more, got {' '.join(map(str, args.stride))}")
    if args.stride is not None and args.mode != "slide":
        raise UsageError("--stride is the step of --mode slide's windows; give --mode slide with it")
    if args.max_patches is not None and args.max_patches < 1:
        raise UsageError(f"--max-patches expects a number of patches of 1 or more, got {args.max_patches}")
    task, source = model_source(args.onnx, args.checkpoint, args.model)
    options = {"topk": args.topk, "max_patches": args.max_patches, "mode": args.mode, "stride": args.stride,
               "token_merging": args.token_merging, "overrides": parse_overrides(args.overrides), "model": args.model,
               "threshold": args.threshold}
    predictor = task.function("predictor")(source, options)
    failed = 0
    for path in args.images:
        try:
            image = read_image(path)
        except UsageError as e:  # one image that cannot be read: its line, and on to the next
            print(one_line(e), file=sys.stderr)
            failed += 1
            continue
        result = predictor.result(image, predictor.run([predictor.prepare(image)])[0], options)
        written = write_files(result.files, Path(args.output), Path(path).stem)
        print(f"{path}: {result.line}" + (f" -> {', '.join(map(str, written))}" if written else ""))
    return 1 if failed else 0


def model_source(onnx: str | None, checkpoint: str | None, model: str | None):
    """(the task of the model a command names, and its source: ``("onnx", OnnxModel)``, ``("program", Int8Program)``
    for an int8 ``.pt2``, ``("checkpoint", path)`` or ``("name", tag)``). An ONNX file runs in onnxruntime on numpy
    arrays: torch is not imported for it."""
    from vitkit.tasks import registry

    if onnx:
        net = onnx_model(onnx)
        return registry.for_onnx(net.meta), ("onnx", net)
    if checkpoint and checkpoint.endswith(".pt2"):  # an int8 program: its own size and preprocessing
        from vitkit.deploy.quantize_program import load_int8_program

        program = load_int8_program(checkpoint)
        return registry.for_onnx(program.meta), ("program", program)
    if checkpoint:
        import vitkit.lit  # noqa: F401 - the class paths checkpoints record (Lightning loads only imported classes)

        return registry.for_file(checkpoint, "predictor"), ("checkpoint", checkpoint)
    if model:
        return registry.other_files(), ("name", model)
    raise UsageError("give --checkpoint FILE, --onnx FILE, or --model NAME for pretrained weights by name (a timm tag "
                     "such as vit_base_patch16_224.augreg2_in21k_ft_in1k, or torchvision weights)")


def read_image(path: str):
    """The image file decoded (PIL), or one line naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(path)
        image.load()
    except (OSError, UnidentifiedImageError) as e:
        raise UsageError(f"cannot read image {path!r}: {e}") from None
    from vitkit.image_files import eight_bit

    return eight_bit(image)


def write_files(files: dict[str, bytes], folder: Path, stem: str) -> list[Path]:
    """A prediction's files (``suffix -> bytes``) as ``folder/<stem><suffix>``."""
    if not files:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for suffix, data in files.items():
        (folder / f"{stem}{suffix}").write_bytes(data)
        out.append(folder / f"{stem}{suffix}")
    return out


def onnx_model(path: str):
    """An exported model in onnxruntime (``vitkit/deploy/onnx_model.py``)."""
    try:
        from vitkit.deploy.onnx_model import OnnxModel
        return OnnxModel(path)
    except ImportError as e:
        raise UsageError(f"--onnx needs onnxruntime ({e}); pip install 'vitkit[export]'") from None
    except Exception as e:  # noqa: BLE001 - onnxruntime's own errors for a missing or damaged file
        raise UsageError(f"cannot load {path!r} in onnxruntime: {e}") from None
