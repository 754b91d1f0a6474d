"""``vitkit predict``: the top-k classes of image files, from a checkpoint, a tag or an exported ONNX file; for a
multi-label classifier, the labels above their thresholds."""

from __future__ import annotations

import sys

from .common import TOKEN_MERGING, add_model_source, command_parser, load_classifier, read_image


def parser():
    p = command_parser("predict")
    p.add_argument("images", nargs="+")
    add_model_source(p, "any format vitkit reads (a .ckpt keeps the class names)",
                     "without --checkpoint: pretrained weights by name (a timm tag or torchvision weights); with it: "
                     "the preset, for formats that do not record it")
    p.add_argument("--topk", type=int, default=None, help="the K most probable classes (default 5; a multi-label "
                   "model prints the labels above their thresholds, and these K too when given)")
    p.add_argument("--onnx", help="an exported model.onnx, run by onnxruntime with the preprocessing in its metadata")
    p.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    return p


def main(argv: list[str]) -> int:
    import torch

    args = parser().parse_args(argv)
    if args.topk is not None and args.topk < 1:
        raise SystemExit(f"error: --topk expects a whole number of classes of 1 or more, got {args.topk}")
    if args.onnx and args.token_merging:
        raise SystemExit("error: --token-merging applies to PyTorch models; an ONNX file merges tokens as it was "
                         "exported (vitkit export --token-merging R)")
    if args.onnx:
        names, probabilities, thresholds = onnx_classifier(args.onnx)
    else:
        net = load_classifier(args)
        names = getattr(net, "class_names", None) or [str(i) for i in range(net.cfg.num_classes)]
        refuse_an_embedding(net, args.model, args.checkpoint)
        thresholds = getattr(net, "thresholds", None)

        def probabilities(image: str) -> torch.Tensor:
            x, _ = read_image(image, net.cfg)
            with torch.no_grad():
                logits = net(x)[0]
            return logits.sigmoid() if thresholds is not None else logits.softmax(-1)

    failed = 0
    for path in args.images:
        try:
            p = probabilities(path)
        except SystemExit as e:  # its message says "error: ..." already, and names the file
            print(e, file=sys.stderr)
            failed += 1
            continue
        if len(names) < len(p):
            names = [str(i) for i in range(len(p))]
        print(f"{path}: {describe(p, names, thresholds, args.topk)}")
    return 1 if failed else 0


def describe(p, names: list[str], thresholds: list[float] | None, topk: int | None) -> str:
    """One image's line: the top-k classes with their probabilities; for a multi-label model, the labels at or
    above their thresholds (most probable first; "none" when none is), then the top-k when asked for."""
    import torch

    def listing(idx: list[int]) -> str:
        return ", ".join(f"{names[i]} {float(p[i]):.3f}" for i in idx)

    top = p.topk(min(topk or 5, len(p))).indices.tolist()
    if thresholds is None:
        return listing(top)
    on = (p >= torch.tensor(thresholds, dtype=p.dtype)).nonzero().flatten().tolist()
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
    raise SystemExit(f"error: {what} is CLIP's image tower: its {net.cfg.num_classes} outputs are its image "
                     "embedding (the projection into CLIP's image-text space), not classes. "
                     + (f"Take a fine-tuned tag ({', '.join(tuned)}), or fine-tune" if tuned else "Fine-tune")
                     + f" it: `vitkit train fit -c vit_base_clip_finetune {source} "
                     "--data.root DATA`")


def onnx_classifier(path: str):
    """(names, image path -> probabilities, the thresholds of a multi-label model or None) of an exported ONNX model,
    run by onnxruntime."""
    import torch
    from PIL import Image, UnidentifiedImageError

    try:
        from vitkit.tools.export import OnnxModel
        model = OnnxModel(path)
    except ImportError as e:
        raise SystemExit(f"error: --onnx needs onnxruntime ({e}); pip install 'vitkit[export]'") from None
    except Exception as e:  # noqa: BLE001 - onnxruntime's own errors for a missing or damaged file
        raise SystemExit(f"error: cannot load {path!r} in onnxruntime: {e}") from None
    n = model.session.get_outputs()[0].shape[-1]
    names = model.labels or [str(i) for i in range(n if isinstance(n, int) else 0)]

    def probabilities(image: str) -> torch.Tensor:
        try:
            img = Image.open(image)
        except (OSError, UnidentifiedImageError) as e:
            raise SystemExit(f"error: cannot read image {image!r}: {e}") from None
        logits = torch.from_numpy(model(model.preprocess(img)))[0]
        return logits.sigmoid() if model.thresholds is not None else logits.softmax(-1)

    return names, probabilities, model.thresholds
