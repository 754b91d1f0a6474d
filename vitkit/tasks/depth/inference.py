"""How a depth model predicts, for ``vitkit predict`` and ``vitkit serve`` (the task protocol's predictor), and how it
is exported: a ``vitkit.lit.DepthEstimator`` checkpoint (the model its run validated) or its ONNX export, the image
resized to the model's square as evaluation resizes it, the map resized back to the image's size: a coloured picture
(near warm, far cool), a 16-bit PNG (a metric model's millimetres; a relative model's range spread over 0-65535) and
the float values (``.npy``)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vitkit.errors import UsageError
from vitkit.tasks.protocol import Prediction, folder_model_type, png_bytes


def claims(path: str) -> bool:
    """A transformers folder of Depth Anything or DPT (``vitkit.load_depth_estimator`` reads it)."""
    return folder_model_type(path) in ("depth_anything", "dpt")


def load_depth_checkpoint(path: str):
    """The model a ``vitkit.lit.DepthEstimator`` checkpoint's run validated (its EMA where that is what it
    validated), in eval mode; or the model of a transformers folder (:func:`claims`)."""
    from .estimator import DepthEstimator

    if claims(path):
        import vitkit

        net = vitkit.load_depth_estimator(path).eval()
        net.name = os.path.basename(os.path.normpath(path))  # what an export records: the folder, not its backbone
        net.class_names = None
        net.max_depth = net.head.max_depth if net.kind == "metric" else None
        return net

    module = DepthEstimator.load_from_checkpoint(path, map_location="cpu").eval()
    net = module.evaluated()
    net.class_names = None
    net.max_depth = module.hparams.max_depth
    return net


def export_model(checkpoint: str, overrides: dict):
    """The depth model of a checkpoint, as ``vitkit export`` writes it (any size already: its ViT's positions are
    resampled to each input's grid)."""
    if overrides:
        raise UsageError(f"{checkpoint} is a depth checkpoint: it exports as it was trained, without --overrides or "
                         "--img-size (its ViT takes any multiple of the patch already)")
    return load_depth_checkpoint(checkpoint)



class _Depth:
    """What both kinds share: a map at the image's size to its line, record and files."""

    size: int
    kind: str
    names: list[str] = []
    draws_overlay = True  # vitkit serve's format=overlay answers the coloured map
    overlay_file = "_depth.png"
    served_files = {"_depth16.png": "depth_png"}  # its JSON answer's map: predict's 16-bit PNG, as base64

    def prepare(self, image) -> Tensor:
        from torchvision import tv_tensors
        from torchvision.transforms import v2
        from torchvision.transforms.v2 import functional as TF

        pixels = tv_tensors.Image(TF.pil_to_tensor(image.convert("RGB")))
        return v2.Resize((self.size, self.size), antialias=True)(pixels).as_subclass(Tensor)

    def result(self, image, output, options: dict[str, Any]) -> Prediction:
        from PIL import Image

        from vitkit.evaluation.depth import coloured, resized_to

        depth = resized_to(torch.as_tensor(np.asarray(output, dtype=np.float32))[None], (image.height, image.width))
        depth = depth[0].numpy()
        low, high = float(depth.min()), float(depth.max())
        if self.kind == "metric":
            cap = f", up to {self.max_depth:g}" if self.max_depth else ""
            line = f"depth {low:.3g} to {high:.3g} (the model's unit{cap})"
            sixteen = np.clip(np.round(depth * 1000), 0, 65535)  # millimetres where the unit is the metre
            near = -depth  # coloured near warm
        else:
            line = f"relative inverse depth {low:.3g} to {high:.3g} (larger is nearer)"
            sixteen = np.round((depth - low) / max(high - low, 1e-12) * 65535)
            near = depth
        record = {"size": [image.height, image.width], "kind": self.kind, "min": low, "max": high,
                  "mean": float(depth.mean())}
        raw = io.BytesIO()
        np.save(raw, depth.astype(np.float32))  # the values themselves: inverse depth, or depth in the model's unit
        files = {"_depth.png": png_bytes(coloured(near)),
                 "_depth16.png": png_bytes(Image.fromarray(sixteen.astype(np.uint16))), "_depth.npy": raw.getvalue()}
        return Prediction(line, record, files)


class TorchDepth(_Depth):
    """A depth checkpoint in PyTorch."""

    def __init__(self, net) -> None:
        self.net, self.kind, self.max_depth = net, net.kind, net.max_depth
        size = net.cfg.img_size
        self.size = int(size if isinstance(size, int) else size[0])
        self.mean = torch.tensor(net.cfg.mean).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(net.cfg.std).view(1, -1, 1, 1) * 255

    @torch.no_grad()
    def run(self, prepared: Sequence[Tensor]) -> list[Tensor]:
        x = (torch.stack(list(prepared)).float() - self.mean) / self.std
        return list(self.net(x))


class OnnxDepth(_Depth):
    """A depth model's ONNX export in onnxruntime, the image resized as the PyTorch model's is."""

    def __init__(self, model) -> None:
        self.model = model
        c, self.size = model.meta["input_size"][0], int(model.meta["input_size"][1])
        depth = model.meta.get("depth") or {}
        self.kind, self.max_depth = depth.get("kind", "relative"), depth.get("max_depth")
        self.mean = np.asarray(model.meta["mean"][:c], np.float32).reshape(1, -1, 1, 1) * 255
        self.std = np.asarray(model.meta["std"][:c], np.float32).reshape(1, -1, 1, 1) * 255

    def run(self, prepared: Sequence[Tensor]) -> list[np.ndarray]:
        x = ((np.stack([p.numpy() for p in prepared]).astype(np.float32) - self.mean) / self.std).astype(np.float32)
        return list(self.model(x))


def predictor(source: tuple[str, Any], options: dict[str, Any]):
    """The depth model of ``source`` (``("onnx", OnnxModel)`` or ``("checkpoint", path)``)."""
    kind, value = source
    if options.get("max_patches") is not None or options.get("token_merging") or options.get("stride") or \
            options.get("mode", "whole") != "whole" or options.get("threshold") is not None:
        raise UsageError("--max-patches, --token-merging, --mode, --stride and --threshold apply to other tasks; a "
                         "depth model takes the image alone")
    if kind == "onnx":
        return OnnxDepth(value)
    if kind != "checkpoint":
        raise UsageError(f"{value}: a depth model is read from its checkpoint or its ONNX export")
    return TorchDepth(load_depth_checkpoint(value))
