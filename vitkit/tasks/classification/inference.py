"""How a classifier predicts, for ``vitkit predict`` and ``vitkit serve`` (the task protocol's predictor) and how it is
exported: a model vitkit builds (a checkpoint, a saved folder, a timm tag) or an exported ONNX file, each with the
preprocessing its file records, one label per image (the top k) or several (the labels above their thresholds).

The ONNX path runs on numpy, Pillow and onnxruntime alone: torch is not imported (``benchmarks/startup.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vitkit.errors import UsageError
from vitkit.tasks.protocol import Prediction


def load_classifier(model: str | None, checkpoint: str | None, overrides: dict | None = None,
                    token_merging: int = 0):
    """The classifier a checkpoint (any format vitkit reads) or a name (a preset, a timm tag, torchvision weights)
    gives, in eval mode; a backbone, an encoder-decoder or a wrong ``token_merging`` is refused in one line."""
    import vitkit
    from vitkit.checkpoints.names import capabilities

    if checkpoint is None and model is None:
        raise UsageError("give --checkpoint FILE, or --model NAME for pretrained weights by name "
                         "(a timm tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k, or torchvision weights)")
    overrides = dict(overrides or {})
    if token_merging:
        overrides["token_merging"] = token_merging
    try:
        net = vitkit.create_model(model, checkpoint=checkpoint, pretrained=checkpoint is None, **overrides).eval()
    except ValueError as e:
        if "token_merging" not in overrides:
            raise
        raise UsageError(f"--token-merging {token_merging}: {e}") from None
    if not capabilities(net.name).images:
        raise UsageError(f"{checkpoint} holds an encoder-decoder ({net.name}); this command takes classifiers")
    require_classifier(net, checkpoint or model)
    return net


def require_classifier(net, source: str) -> None:
    """Refuse a backbone: a model without a classifier, or with one that the weights did not hold."""
    report = getattr(net, "load_report", None)
    if net.cfg.num_classes == 0 or (report is not None and report.new_head):
        what = "has no classifier head (num_classes=0)" if net.cfg.num_classes == 0 else (
            f"holds no classifier for the {net.cfg.num_classes} classes asked for (new, untrained: "
            f"{', '.join(report.new_head)})")
        raise UsageError(f"{source} {what}: it is a backbone, so there are no classes to predict. Fine-tune "
                         "it first, e.g. `vitkit train fit -c finetune_small_data --model.model_name "
                         f"{net.name} --model.pretrained false --model.checkpoint {source} --data.root DATA` (a few "
                         "labelled images per class; vit_base_finetune for thousands), then use the checkpoint that "
                         "writes")


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


def export_model(checkpoint: str, overrides: dict):
    """The classifier of a model file, as ``vitkit export`` writes it (``overrides``: config fields, and ``model``
    and ``token_merging`` as the command gives them)."""
    overrides = dict(overrides)
    model, merging = overrides.pop("model", None), overrides.pop("token_merging", 0)
    return load_classifier(model, checkpoint, overrides, merging)


def describe(p: np.ndarray, names: list[str], thresholds: Sequence[float] | None, topk: int | None) -> str:
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


def record(p: np.ndarray, names: list[str], thresholds: Sequence[float] | None, topk: int | None) -> dict:
    """One image's answer as plain values: the top-k classes and their probabilities, and for a multi-label model
    the labels at or above their thresholds."""
    p = np.asarray(p, dtype=np.float64)
    top = np.argsort(-p, kind="stable")[:min(topk or 5, len(p))].tolist()
    out: dict[str, Any] = {"top": [{"label": names[i], "probability": float(p[i])} for i in top]}
    if thresholds is not None:
        on = sorted(np.flatnonzero(p >= np.asarray(thresholds, dtype=np.float64)).tolist(), key=lambda i: -float(p[i]))
        out["labels"] = [{"label": names[i], "probability": float(p[i]), "threshold": float(thresholds[i])}
                         for i in on]
    return out


class _Classifier:
    """What both kinds of classifier share: probabilities to a :class:`Prediction`."""

    names: list[str]
    thresholds: list[float] | None

    def result(self, image, output: np.ndarray, options: dict[str, Any]) -> Prediction:
        if len(self.names) < len(output):
            self.names = [str(i) for i in range(len(output))]
        topk = options.get("topk")
        return Prediction(describe(output, self.names, self.thresholds, topk),
                          record(output, self.names, self.thresholds, topk))


def probabilities(logits: np.ndarray, multi_label: bool) -> np.ndarray:
    """A row of logits as probabilities: a sigmoid each (several labels), else a softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if multi_label:
        return 1.0 / (1.0 + np.exp(-logits))
    e = np.exp(logits - logits.max())
    return e / e.sum()


class OnnxClassifier(_Classifier):
    """An exported classifier in onnxruntime, with the preprocessing its metadata records."""

    def __init__(self, model) -> None:
        self.model = model
        n = model.session.get_outputs()[0].shape[-1]
        self.names = list(model.labels or [str(i) for i in range(n if isinstance(n, int) else 0)])
        self.thresholds = model.thresholds

    def prepare(self, image) -> np.ndarray:
        return self.model.preprocess(image)[0]

    def run(self, prepared: Sequence[np.ndarray]) -> list[np.ndarray]:
        shapes = {x.shape for x in prepared}
        logits = self.model(np.stack(prepared)) if len(shapes) == 1 else \
            np.concatenate([self.model(x[None]) for x in prepared])  # whole images of their own shapes
        return [probabilities(row, self.thresholds is not None) for row in logits]


class ProgramClassifier(OnnxClassifier):
    """An int8 ``.pt2`` program (``vitkit export --format torch-export --int8``), compiled on its first call, with the
    preprocessing its metadata records (the ONNX path's, in PIL and numpy)."""

    def __init__(self, program) -> None:
        self.model, self.names, self.thresholds = program, list(program.meta.get("labels") or []), None

    def prepare(self, image) -> np.ndarray:
        from vitkit.deploy.onnx_model import preprocess_image

        return preprocess_image(image, self.model.meta, "the program")[0]

    def run(self, prepared: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            logits = self.model(torch.from_numpy(np.stack(prepared))).numpy()
        if len(self.names) < logits.shape[-1]:
            self.names = [str(i) for i in range(logits.shape[-1])]
        return [probabilities(row, False) for row in logits]


class TorchClassifier(_Classifier):
    """A classifier vitkit built, with its eval transform; with ``max_patches`` each image whole within that patch
    budget at its aspect ratio, the images of a batch packed into sequences (as ``--data.packing`` evaluates)."""

    def __init__(self, net, max_patches: int | None = None) -> None:
        from vitkit.data.transforms import eval_transform

        self.net, self.max_patches = net, max_patches
        self.names = list(getattr(net, "class_names", None) or [str(i) for i in range(net.cfg.num_classes)])
        self.thresholds = getattr(net, "thresholds", None)
        self.plan = None
        if max_patches is not None:
            from vitkit.data.packing import packing_for

            try:
                self.plan = packing_for(net, None, net.cfg.img_size, max_patches, None)
            except ValueError as e:
                raise UsageError(str(e).replace("--data.packing", "--max-patches")) from None
        self.transform = eval_transform(net.cfg) if self.plan is None else self.plan.eval_transform(net.cfg)

    def prepare(self, image):
        return self.transform(image.convert("L" if self.net.cfg.in_chans == 1 else "RGB"))

    def run(self, prepared: Sequence) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            if self.plan is not None:  # images of their own shapes, packed
                logits = self.net(self.plan.collate([(x, 0) for x in prepared])[0])
            else:
                logits = self.net(torch.stack(list(prepared)))
        return [probabilities(row, self.thresholds is not None) for row in logits.float().numpy()]


def predictor(source: tuple[str, Any], options: dict[str, Any]):
    """The classifier of ``source`` (``("onnx", OnnxModel)``, ``("program", Int8Program)``, ``("checkpoint", path)``
    or ``("name", tag)``) for
    ``vitkit predict`` and ``vitkit serve``; ``options``: the command's (``topk``, ``max_patches``, ``overrides``,
    ``token_merging``, ``mode``)."""
    kind, value = source
    if kind == "program":  # an int8 .pt2: its own size and preprocessing
        return ProgramClassifier(value)
    if options.get("mode", "whole") != "whole" or options.get("stride"):
        raise UsageError("--mode slide and --stride apply to a segmenter (a vitkit.lit.Segmenter checkpoint, or its "
                         "ONNX export)")
    if kind == "onnx":
        if options.get("token_merging"):
            raise UsageError("--token-merging applies to PyTorch models; an ONNX file merges tokens as it was "
                             "exported (vitkit export --token-merging R)")
        if options.get("max_patches") is not None:  # the budget each image is resized within
            if not value.packed:
                raise UsageError(f"--max-patches with --onnx takes a file exported with --packed; {value.path} takes "
                                 "its exported size")
            value.meta["max_patches"] = options["max_patches"]
        return OnnxClassifier(value)
    checkpoint, model = (value, options.get("model")) if kind == "checkpoint" else (None, value)
    net = load_classifier(model, checkpoint, options.get("overrides"), options.get("token_merging", 0))
    refuse_an_embedding(net, model, checkpoint)
    max_patches = options.get("max_patches")
    if max_patches is None:  # a model trained on packed batches predicts as it was validated
        max_patches = getattr(net.cfg, "max_patches", None)
    return TorchClassifier(net, max_patches)
