"""How a detector predicts, for ``vitkit predict`` and ``vitkit serve`` (the task protocol's predictor), and how it is
exported: a ``vitkit.lit.Detector`` checkpoint (the model its run validated) or its ONNX export, the image
letterboxed as the run evaluated it, the boxes above a score drawn on the image with their labels and scores, and
listed in COCO's result format (x, y, width, height in the image's pixels)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.models.detection import YOLOS, DetectionOutput, corners, to_pixels
from vitkit.models.rf_detr import RFDETR
from vitkit.tasks.protocol import Prediction, folder_model_type, png_bytes

THRESHOLD = 0.5  # the least score a predicted box is drawn and listed with, unless the command gives another


class ExportedDetector(nn.Module):
    """A detector as its export runs it: letterboxed, normalised images (B, 3, S, S) -> ``boxes`` (B, Q, 4: corners
    relative to the input; ``models.detection.to_pixels`` maps them to the image's), ``scores`` (B, Q) and
    ``labels`` (B, Q):
    each query's likeliest class other than "no object" and its probability."""

    task = "detection"
    output_names = ("boxes", "scores", "labels")

    def __init__(self, detector: YOLOS | RFDETR, name: str, class_names: list[str]) -> None:
        super().__init__()
        self.detector, self.name, self.class_names = detector, name, list(class_names)
        self.backbone = detector.backbone  # the network whose architecture decides the sizes an export takes
        self.cfg = detector.backbone.cfg
        self.size_multiple = getattr(detector, "img_multiple", None)  # RF-DETR's: the patch times its windows
        self.category_ids: list | None = None  # a COCO file's id of each class: what predictions name

    @property
    def extra_metadata(self) -> dict[str, Any]:
        """What an export records beside the labels: the classes' COCO category ids, where the run had them."""
        return {"category_ids": self.category_ids} if self.category_ids is not None else {}

    def set_attn_backend(self, backend: str) -> None:
        self.backbone.set_attn_backend(backend)

    def set_dynamic_img_size(self, enable: bool = True) -> None:
        self.backbone.set_dynamic_img_size(enable)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out: DetectionOutput = self.detector(x)
        scores, labels = out.scores()
        return corners(out.boxes.float()), scores, labels


def claims(path: str) -> bool:
    """A transformers folder of YOLOS, RF-DETR or LW-DETR, or a ``.pth`` of RF-DETR's own code (its weights under
    ``model`` and its settings under ``args``): what ``vitkit.load_detector`` reads."""
    if folder_model_type(path) in ("yolos", "rf_detr", "lw_detr"):
        return True
    if not str(path).endswith((".pth", ".pt")) or not os.path.isfile(path):
        return False
    from vitkit.checkpoints.files import SAFE_GLOBALS

    try:  # memory-mapped: a classifier's file of hundreds of MB is not read to be told apart
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a file this task claims; the task that takes it says what is wrong
        return False
    return isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "args" in raw


def load_detector_checkpoint(path: str) -> ExportedDetector:
    """The model a ``vitkit.lit.Detector`` checkpoint's run validated (its EMA where that is what it validated), in
    eval mode, as its export runs it; or the detector of another library's file (:func:`claims`)."""
    from .detector import Detector

    if claims(path):
        import vitkit

        net = vitkit.load_detector(path).eval()
        multiple, side = getattr(net, "img_multiple", 1), net.backbone.cfg.img_size
        side = side if isinstance(side, int) else side[0]
        if side % multiple:  # RF-DETR's positions are made at 518 px (37 patches) and its images are 560: the
            net.backbone.set_input_size(-(-side // multiple) * multiple)  # letterbox's square, whole windows
        names = list(net.class_names or [str(i) for i in range(net.num_classes)])
        name = Path(path).stem if os.path.isfile(path) else Path(path).name  # the file's, not its backbone preset's
        exported = ExportedDetector(net, name, names).eval()
        exported.max_detections = 100  # COCO's
        return exported

    module = Detector.load_from_checkpoint(path, map_location="cpu").eval()
    net = module.evaluated()
    names = list(module.hparams.class_names or [str(i) for i in range(net.num_classes)])
    exported = ExportedDetector(net, net.backbone.name, names).eval()
    exported.max_detections = module.hparams.max_detections
    exported.category_ids = module.hparams.get("category_ids")
    return exported


def export_model(checkpoint: str, overrides: dict) -> ExportedDetector:
    """The detector of a checkpoint, as ``vitkit export`` writes it."""
    if overrides:
        net = load_detector_checkpoint(checkpoint)
        multiple = net.size_multiple or net.backbone.patch_size
        raise UsageError(f"{checkpoint} is a detection checkpoint: it exports as it was trained, without --overrides "
                         f"or --img-size (its file takes any height and width that are multiples of {multiple} px "
                         "already)")
    return load_detector_checkpoint(checkpoint)


def letterboxed(image, size: int) -> Tensor:
    """A PIL image as the run evaluated it: its longer side resized to ``size``, padded at the right and bottom to
    a square (uint8, 3 x size x size)."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as TF

    from vitkit.data.modules.detection import Letterbox

    return Letterbox(size)(tv_tensors.Image(TF.pil_to_tensor(image.convert("RGB")))).as_subclass(Tensor)



def drawn(image, found: list[dict[str, Any]]):
    """The image with each box drawn, its label and score above it, a colour per class."""
    from PIL import ImageDraw

    from vitkit.masks import palette

    out = image.convert("RGB")
    draw = ImageDraw.Draw(out)
    colours = palette(max([d["index"] for d in found], default=0) + 1)
    for d in found:
        x, y, w, h = d["bbox"]
        colour = tuple(int(c) for c in colours[d["index"]])
        draw.rectangle([x, y, x + w, y + h], outline=colour, width=max(1, round(min(out.size) / 200)))
        draw.text((x + 2, max(0, y - 11)), f"{d['label']} {d['score']:.2f}", fill=colour)
    return out


class _Detector:
    """What both kinds share: detections to their line, record (COCO's result format) and files."""

    names: list[str]
    size: int
    draws_overlay = True  # its files hold _overlay.png, the boxes drawn: what vitkit serve answers to format=overlay

    def prepare(self, image) -> Tensor:
        return letterboxed(image, self.size)

    def result(self, image, found: dict[str, Tensor], options: dict[str, Any]) -> Prediction:
        threshold = options.get("threshold")
        threshold = THRESHOLD if threshold is None else threshold
        keep = found["scores"] >= threshold
        listed = []
        for box, score, label in zip(found["boxes"][keep].tolist(), found["scores"][keep].tolist(),
                                     found["labels"][keep].tolist(), strict=True):
            name = self.names[label] if label < len(self.names) else str(label)
            ids = self.category_ids
            category = ids[label] if ids is not None and label < len(ids) else int(label) + 1
            listed.append({"label": name, "index": int(label), "category_id": category, "score": float(score),
                           "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
        counts: dict[str, int] = {}
        for d in listed:
            counts[d["label"]] = counts.get(d["label"], 0) + 1
        line = (", ".join(f"{k} ({n})" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "no objects") + \
            f" (score >= {threshold:g})"
        record = {"size": [image.height, image.width], "detections": listed}
        files = {"_overlay.png": png_bytes(drawn(image, listed)), "_detections.json": json.dumps(listed).encode()}
        return Prediction(line, record, files)

    def found(self, outputs: tuple, sizes: list[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """Per image, its best queries (``max_detections``) in the image's own pixels, from the export's outputs."""
        boxes, scores, labels = (torch.as_tensor(np.asarray(o)) for o in outputs)
        result = []
        for i, size in enumerate(sizes):
            top = scores[i].argsort(descending=True)[:self.max_detections]
            result.append({"boxes": to_pixels(boxes[i][top].float(), size, self.size), "scores": scores[i][top],
                           "labels": labels[i][top].long()})
        return result


class TorchDetector(_Detector):
    """A detector's checkpoint in PyTorch."""

    def __init__(self, net: ExportedDetector) -> None:
        self.net, self.names, self.category_ids = net, net.class_names, net.category_ids
        self.size, self.max_detections = int(net.cfg.img_size if isinstance(net.cfg.img_size, int) else
                                             net.cfg.img_size[0]), getattr(net, "max_detections", 100)
        self.mean = torch.tensor(net.cfg.mean).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(net.cfg.std).view(1, -1, 1, 1) * 255

    @torch.no_grad()
    def run(self, prepared: Sequence[Tensor]) -> list[tuple]:
        x = (torch.stack(list(prepared)).float() - self.mean) / self.std
        boxes, scores, labels = self.net(x)
        return [(boxes[i], scores[i], labels[i]) for i in range(len(x))]

    def result(self, image, output: tuple, options: dict[str, Any]) -> Prediction:
        found = self.found(tuple(o[None] for o in output), [(image.height, image.width)])[0]
        return super().result(image, found, options)


class OnnxDetector(_Detector):
    """A detector's ONNX export in onnxruntime, the image letterboxed as the PyTorch model's is."""

    def __init__(self, model) -> None:
        self.model, self.names = model, list(model.labels or [])
        self.category_ids = model.meta.get("category_ids")
        self.size, self.max_detections = int(model.meta["input_size"][1]), 100
        c = model.meta["input_size"][0]
        self.mean = np.asarray(model.meta["mean"][:c], np.float32).reshape(1, -1, 1, 1) * 255
        self.std = np.asarray(model.meta["std"][:c], np.float32).reshape(1, -1, 1, 1) * 255

    def run(self, prepared: Sequence[Tensor]) -> list[tuple]:
        x = ((np.stack([p.numpy() for p in prepared]).astype(np.float32) - self.mean) / self.std).astype(np.float32)
        boxes, scores, labels = self.model.outputs(x)
        return [(boxes[i], scores[i], labels[i]) for i in range(len(x))]

    def result(self, image, output: tuple, options: dict[str, Any]) -> Prediction:
        found = self.found(tuple(np.asarray(o)[None] for o in output), [(image.height, image.width)])[0]
        return super().result(image, found, options)


def predictor(source: tuple[str, Any], options: dict[str, Any]):
    """The detector of ``source`` (``("onnx", OnnxModel)`` or ``("checkpoint", path)``); ``options``: the command's
    (``threshold``)."""
    kind, value = source
    if options.get("max_patches") is not None or options.get("token_merging") or options.get("stride") or \
            options.get("mode", "whole") != "whole":
        raise UsageError("--max-patches, --token-merging, --mode and --stride apply to classifiers and segmenters; "
                         "a detector takes --threshold")
    threshold = options.get("threshold")
    if threshold is not None and not 0 <= threshold <= 1:
        raise UsageError(f"--threshold is a score from 0 to 1, got {threshold}")
    if kind == "onnx":
        return OnnxDetector(value)
    if kind != "checkpoint":
        raise UsageError(f"{value}: a detector is read from its checkpoint or its ONNX export")
    return TorchDetector(load_detector_checkpoint(value))

