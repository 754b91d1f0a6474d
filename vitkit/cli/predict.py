"""``vitkit predict``: the top-k classes of image files, from a checkpoint, a tag or an exported ONNX file; for a
multi-label classifier, the labels above their thresholds."""

from __future__ import annotations

import sys

import numpy as np

from vitkit.errors import UsageError, one_line

from .common import TOKEN_MERGING, add_model_source, command_parser, image_paths, load_classifier, read_image


def parser():
    p = command_parser("predict")
    p.add_argument("images", nargs="+", help="image files, or folders of them (every image inside, sorted)")
    add_model_source(p, "any format vitkit reads (a .ckpt keeps the class names)",
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
    p.add_argument("-o", "--output", default="masks", help="a segmentation checkpoint (vitkit.lit.Segmenter): the "
                   "folder for each image's NAME_mask.png (class indices, coloured) and NAME_overlay.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.images = image_paths(args.images)
    if args.topk is not None and args.topk < 1:
        raise UsageError(f"--topk expects a whole number of classes of 1 or more, got {args.topk}")
    if args.onnx and args.token_merging:
        raise UsageError("--token-merging applies to PyTorch models; an ONNX file merges tokens as it was "
                         "exported (vitkit export --token-merging R)")
    if args.stride is not None and (len(args.stride) > 2 or min(args.stride) < 1):
        raise UsageError(f"--stride takes H W or one number, each 1 or more, got {' '.join(map(str, args.stride))}")
    if args.stride is not None and args.mode != "slide":
        raise UsageError("--stride is the step of --mode slide's windows; give --mode slide with it")
    if args.max_patches is not None and args.max_patches < 1:
        raise UsageError(f"--max-patches expects a number of patches of 1 or more, got {args.max_patches}")
    if args.checkpoint and not args.onnx and segmentation_checkpoint(args.checkpoint):
        return predict_masks(args)
    # an ONNX file runs in onnxruntime on numpy arrays: torch is not imported (benchmarks/startup.py)
    onnx = onnx_model(args.onnx) if args.onnx else None
    if onnx is not None and args.max_patches is not None:  # the budget each image is resized within
        if not onnx.packed:
            raise UsageError(f"--max-patches with --onnx takes a file exported with --packed; {args.onnx} takes its "
                             "exported size")
        onnx.meta["max_patches"] = args.max_patches
    segmenter = onnx is not None and onnx.meta.get("task") == "segmentation"
    if args.mode != "whole" and not segmenter:
        raise UsageError("--mode slide applies to a segmenter (a vitkit.lit.Segmenter checkpoint, or its ONNX export)")
    if segmenter:
        stride = None if args.stride is None else (args.stride[0], args.stride[-1])
        return write_masks(args, onnx.labels or [], lambda image: onnx.segment(image, args.mode, stride))
    names, probabilities, thresholds = onnx_classifier(onnx) if onnx is not None else torch_classifier(args)
    failed = 0
    for path in args.images:
        try:
            p = probabilities(path)
        except UsageError as e:  # one image that cannot be read: its line, and on to the next
            print(one_line(e), file=sys.stderr)
            failed += 1
            continue
        if len(names) < len(p):
            names = [str(i) for i in range(len(p))]
        print(f"{path}: {describe(p, names, thresholds, args.topk)}")
    return 1 if failed else 0


def segmentation_checkpoint(path: str) -> dict | None:
    """The hyper-parameters of ``path`` where it is a checkpoint of ``vitkit.lit.Segmenter`` (its recorded class path
    says so), else None."""
    if not path.endswith(".ckpt"):
        return None
    import torch

    try:
        hp = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters") or {}
    except Exception:  # noqa: BLE001 - not a checkpoint torch reads safely: the classifier path says what it is
        return None
    return dict(hp) if str(hp.get("_class_path", "")).endswith(".Segmenter") else None


def predict_masks(args) -> int:
    """A segmentation checkpoint's masks (``write_masks``)."""
    from vitkit.evaluation.segmentation import predict_mask
    from vitkit.lit import Segmenter
    from vitkit.models.config import pair

    module = Segmenter.load_from_checkpoint(args.checkpoint, map_location="cpu").eval()
    cfg = module.model.backbone.cfg
    names = module.hparams.class_names or [str(i) for i in range(module.model.num_classes)]
    stride = None if args.stride is None else (args.stride[0], args.stride[-1])
    return write_masks(args, names, lambda image: predict_mask(module, image, pair(cfg.img_size), cfg.mean, cfg.std,
                                                               args.mode, stride))


def write_masks(args, names: list[str], mask_of) -> int:
    """Each image's mask (``mask_of(PIL image)``, a class per pixel) and overlay, written under ``--output``; a line
    per image with its largest classes."""
    from pathlib import Path

    from PIL import Image, UnidentifiedImageError

    from vitkit.tools.masks import save_mask

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in args.images:
        try:
            image = Image.open(path)
            image.load()
        except (OSError, UnidentifiedImageError) as e:
            print(one_line(UsageError(f"cannot read image {path!r}: {e}")), file=sys.stderr)
            failed += 1
            continue
        mask = mask_of(image)
        names = names if len(names) > mask.max() else [str(i) for i in range(int(mask.max()) + 1)]
        mask_file, overlay = save_mask(mask, image, out / Path(path).stem, len(names))
        counts = np.bincount(mask.ravel(), minlength=len(names)) / mask.size
        top = ", ".join(f"{names[i]} {counts[i]:.0%}" for i in np.argsort(-counts, kind="stable")[:3] if counts[i])
        print(f"{path}: {top} -> {mask_file}, {overlay}")
    return 1 if failed else 0


def torch_classifier(args):
    """(names, image path -> probabilities as a numpy array, the thresholds of a multi-label model or None) of a
    model vitkit builds."""
    import torch

    net = load_classifier(args)
    names = getattr(net, "class_names", None) or [str(i) for i in range(net.cfg.num_classes)]
    refuse_an_embedding(net, args.model, args.checkpoint)
    thresholds = getattr(net, "thresholds", None)
    if args.max_patches is None:  # a model trained on packed batches predicts as it was validated
        args.max_patches = getattr(net.cfg, "max_patches", None)
    if args.max_patches is not None:  # the whole image at its aspect ratio, one packed sequence
        from vitkit.data.packing import packing_for

        try:
            plan = packing_for(net, None, net.cfg.img_size, args.max_patches, None)
        except ValueError as e:
            raise UsageError(str(e).replace("--data.packing", "--max-patches")) from None

    def probabilities(image: str) -> np.ndarray:
        x, _ = read_image(image, net.cfg) if args.max_patches is None else \
            read_image(image, net.cfg, plan.eval_transform(net.cfg))
        if args.max_patches is not None:
            x = plan.collate([(x[0], 0)])[0]
        with torch.no_grad():
            logits = net(x)[0].float()
        return (logits.sigmoid() if thresholds is not None else logits.softmax(-1)).numpy()

    return names, probabilities, thresholds


def describe(p: np.ndarray, names: list[str], thresholds: list[float] | None, topk: int | None) -> str:
    """One image's line: the top-k classes with their probabilities; for a multi-label model, the labels at or
    above their thresholds (most probable first; "none" when none is), then the top-k when asked for."""
    p = np.asarray(p, dtype=np.float64)

    def listing(idx) -> str:
        return ", ".join(f"{names[i]} {float(p[i]):.3f}" for i in idx)

    top = np.argsort(-p, kind="stable")[:min(topk or 5, len(p))].tolist()
    if thresholds is None:
        return listing(top)
    on = np.flatnonzero(p >= np.asarray(thresholds, dtype=np.float64)).tolist()
    line = listing(sorted(on, key=lambda i: -float(p[i]))) or "none"
    return line + (f"  (top {len(top)}: {listing(top)})" if topk else "")


def refuse_an_embedding(net, tag: str | None, checkpoint: str | None = None) -> None:
    """CLIP's image towers (by tag, or from an OpenAI / OpenCLIP / transformers CLIP file) end in CLIP's projection
    into the image-text space: those outputs are an embedding, not classes (the fine-tuned tags, ``*_ft_in1k``,
    have a classifier and label names)."""
    from vitkit.checkpoints.formats import FORMATS

    report = getattr(net, "load_report", None)
    by_tag = tag and "_clip_" in net.name and "." in tag and "_ft_" not in tag
    by_file = checkpoint and report is not None and report.format in FORMATS and FORMATS[report.format].embedding_head
    if not (by_tag or by_file) or getattr(net, "class_names", None):
        return
    import timm

    tuned = timm.list_pretrained(f"{net.name}.*_ft_*") if by_tag else []
    source = f"--model.model_name {tag}" if by_tag else \
        f"--model.model_name {net.name} --model.pretrained false --model.checkpoint {checkpoint}"
    what = tag if by_tag else f"{checkpoint} ({report.format})"
    raise UsageError(f"{what} is CLIP's image tower: its {net.cfg.num_classes} outputs are its image "
                     "embedding (the projection into CLIP's image-text space), not classes. "
                     + (f"Take a fine-tuned tag ({', '.join(tuned)}), or fine-tune" if tuned else "Fine-tune")
                     + f" it: `vitkit train fit -c vit_base_clip_finetune {source} "
                     "--data.root DATA`")


def onnx_model(path: str):
    """An exported model in onnxruntime (``vitkit/tools/onnx_model.py``)."""
    try:
        from vitkit.tools.onnx_model import OnnxModel
        return OnnxModel(path)
    except ImportError as e:
        raise UsageError(f"--onnx needs onnxruntime ({e}); pip install 'vitkit[export]'") from None
    except Exception as e:  # noqa: BLE001 - onnxruntime's own errors for a missing or damaged file
        raise UsageError(f"cannot load {path!r} in onnxruntime: {e}") from None


def onnx_classifier(model):
    """(names, image path -> probabilities, the thresholds of a multi-label model or None) of an exported ONNX
    classifier (``onnx_model``), run by onnxruntime."""
    from PIL import Image, UnidentifiedImageError

    n = model.session.get_outputs()[0].shape[-1]
    names = model.labels or [str(i) for i in range(n if isinstance(n, int) else 0)]

    def probabilities(image: str) -> np.ndarray:
        try:
            img = Image.open(image)
            x = model.preprocess(img)
        except (OSError, UnidentifiedImageError) as e:
            raise UsageError(f"cannot read image {image!r}: {e}") from None
        logits = model(x)[0].astype(np.float64)
        if model.thresholds is not None:
            return 1.0 / (1.0 + np.exp(-logits))
        e = np.exp(logits - logits.max())
        return e / e.sum()

    return names, probabilities, model.thresholds
