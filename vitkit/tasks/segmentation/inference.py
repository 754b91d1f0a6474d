"""How a segmenter predicts, for ``vitkit predict`` and ``vitkit serve`` (the task protocol's predictor), and how it is
exported: a ``vitkit.lit.Segmenter`` checkpoint (the model its run validated) or its ONNX export, the class of every
pixel at the image's own size (``whole``: the image resized to the model's size and the logits back; ``slide``:
windows of the model's size over the image as it is), as a palette PNG, an overlay and each class's share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vitkit.errors import UsageError
from vitkit.tasks.protocol import Prediction, png_bytes


def load_segmenter_checkpoint(path: str):
    """(the model a ``vitkit.lit.Segmenter`` checkpoint's run validated, in eval mode, with ``class_names``)."""
    from .segmenter import Segmenter

    module = Segmenter.load_from_checkpoint(path, map_location="cpu").eval()
    net = module.evaluated()  # the run's model: its EMA where that is what it validated
    net.class_names = list(module.hparams.class_names or [str(i) for i in range(net.num_classes)])
    net.ignore_index = module.hparams.ignore_index
    return net


def export_model(checkpoint: str, overrides: dict):
    """The segmenter of a checkpoint, as ``vitkit export`` writes it (as trained: it takes any size already)."""
    if overrides:
        raise UsageError(f"{checkpoint} is a segmentation checkpoint: it exports as it was trained, without "
                         "--overrides or --img-size (a ViT backbone's export takes any size)")
    return load_segmenter_checkpoint(checkpoint)



class _Segmenter:
    """What both kinds share: a mask to its files, its line and its record."""

    names: list[str]
    draws_overlay = True  # its files hold _overlay.png: what vitkit serve answers to format=overlay
    served_files = {"_mask.png": "mask_png"}  # its JSON answer's mask: a palette PNG of class indices, as base64

    def result(self, image, mask: np.ndarray, options: dict[str, Any]) -> Prediction:
        from vitkit.masks import mask_image, overlay_image

        names = self.names if len(self.names) > mask.max() else [str(i) for i in range(int(mask.max()) + 1)]
        shares = np.bincount(mask.ravel(), minlength=len(names)) / mask.size
        order = [int(i) for i in np.argsort(-shares, kind="stable") if shares[i]]
        line = ", ".join(f"{names[i]} {shares[i]:.0%}" for i in order[:3])
        record = {"size": [int(mask.shape[0]), int(mask.shape[1])],
                  "classes": [{"label": names[i], "index": i, "share": float(shares[i])} for i in order]}
        files = {"_mask.png": png_bytes(mask_image(mask, len(names))),
                 "_overlay.png": png_bytes(overlay_image(mask, image, len(names)))}
        return Prediction(line, record, files)


class OnnxSegmenter(_Segmenter):
    """A segmenter's ONNX export in onnxruntime (numpy: no torch), its windows cut and averaged in numpy."""

    def __init__(self, model, mode: str, stride: tuple[int, int] | None) -> None:
        self.model, self.mode, self.stride = model, mode, stride
        self.names = list(model.labels or [])

    def prepare(self, image):
        return image

    def run(self, prepared: Sequence) -> list[np.ndarray]:
        return [self.model.segment(image, self.mode, self.stride) for image in prepared]


class TorchSegmenter(_Segmenter):
    """A segmenter's checkpoint in PyTorch, at the image's own size."""

    def __init__(self, net, mode: str, stride: tuple[int, int] | None) -> None:
        from vitkit.models.config import pair

        self.net, self.mode, self.stride = net, mode, stride
        self.size, self.names = pair(net.cfg.img_size), list(net.class_names)

    def prepare(self, image):
        return image

    def run(self, prepared: Sequence) -> list[np.ndarray]:
        from vitkit.evaluation.segmentation import predict_mask

        cfg = self.net.cfg
        return [predict_mask(self.net, image, self.size, cfg.mean, cfg.std, self.mode, self.stride)
                for image in prepared]


def predictor(source: tuple[str, Any], options: dict[str, Any]):
    """The segmenter of ``source`` (``("onnx", OnnxModel)`` or ``("checkpoint", path)``); ``options``: the command's
    (``mode``, ``stride``)."""
    kind, value = source
    stride = options.get("stride")
    stride = None if stride is None else (stride[0], stride[-1])
    mode = options.get("mode", "whole")
    if options.get("max_patches") is not None or options.get("token_merging"):
        raise UsageError("--max-patches and --token-merging apply to a classifier; a segmenter takes --mode and "
                         "--stride")
    if kind == "onnx":
        return OnnxSegmenter(value, mode, stride)
    if kind != "checkpoint":
        raise UsageError(f"{value}: a segmenter is read from its checkpoint or its ONNX export")
    return TorchSegmenter(load_segmenter_checkpoint(value), mode, stride)
