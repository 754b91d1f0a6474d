"""An exported classifier in onnxruntime, with the preprocessing its metadata records: what ``vitkit predict --onnx``
and ``vitkit evaluate --onnx`` run. numpy, Pillow and onnxruntime only: no torch, so a command that runs an export
starts in a fraction of the time one that imports torch takes (``benchmarks/startup.py``)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import CheckpointError, UsageError, UsageTypeError
from vitkit.patch_budget import budget_size

# what each vitkit.* metadata entry of an export holds, as (JSON type check, what the message says it should be)
_METADATA = {
    "input_size": (lambda v: _ints(v, 3), "a list of 3 positive ints (C, H, W)"),
    "dynamic_size": (lambda v: isinstance(v, bool), "true or false"),
    "size_multiple": (lambda v: _ints([v], 1), "a positive int"),
    "min_size": (lambda v: _ints(v, 2), "a list of 2 positive ints"),
    "mean": (lambda v: _numbers(v), "a list of numbers"),
    "std": (lambda v: _numbers(v) and all(x > 0 for x in v), "a list of positive numbers"),
    "crop_pct": (lambda v: _numbers([v]) and 0 < v <= 1, "a number in (0, 1]"),
    "max_patches": (lambda v: _ints([v], 1), "a positive int"),
    "patch_size": (lambda v: _ints([v], 1), "a positive int"),
    "packed": (lambda v: isinstance(v, bool), "true or false"),
    "prefix": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "labels": (lambda v: v is None or isinstance(v, list) and all(isinstance(x, str) for x in v),
               "null or a list of strings"),
    "thresholds": (lambda v: v is None or _numbers(v) and all(0 <= x <= 1 for x in v),
                   "null or a list of numbers in [0, 1]"),
    "category_ids": (lambda v: isinstance(v, list) and all(isinstance(x, (int, str)) and not isinstance(x, bool)
                                                           for x in v), "a list of ints or strings"),
}


def _ints(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                       for x in v)


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def read_metadata(path: str, meta: dict[str, str]) -> dict[str, Any]:
    """The ``vitkit.*`` metadata of an export, each entry checked; a damaged one is the file's error."""
    out: dict[str, Any] = {}
    for key, text in meta.items():
        name = key.removeprefix("vitkit.")
        if not key.startswith("vitkit.") or name == "model":
            continue
        if name in ("interpolation", "crop_mode", "task"):
            if name == "crop_mode" and text not in ("center", "squash"):  # models.config.CROP_MODES (torch-free here)
                raise CheckpointError(f"{path}: its metadata {key} should be center or squash, got {text[:60]!r}")
            if name == "task" and not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", text):  # a task's name
                raise CheckpointError(f"{path}: its metadata {key} should be a task's name (classification, "
                                      f"segmentation, ...), got {text[:60]!r}")
            out[name] = text
            continue
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: its metadata {key} is not valid JSON ({e})") from None
        check, what = _METADATA.get(name, (lambda v: True, ""))
        if not check(value):
            raise CheckpointError(f"{path}: its metadata {key} should be {what}, got {text[:60]!r}")
        out[name] = value
    ids, labels = out.get("category_ids"), out.get("labels")
    if ids is not None and labels is not None and len(ids) != len(labels):
        raise CheckpointError(f"{path}: its metadata vitkit.category_ids names {len(ids)} ids for its "
                              f"{len(labels)} labels")
    return out


def preprocess_image(image, meta: dict[str, Any], path: str) -> np.ndarray:
    """A PIL image -> the (1, C, H, W) float32 input, with the eval transform an export's metadata ``meta`` records
    (timm's: resize the shorter side to size / crop_pct, centre crop, normalise; or with crop_mode "squash" the whole
    image resized to the size; or for a model trained on packed batches the whole image resized within its patch
    budget at its aspect ratio), in PIL and numpy. ``path`` names the export in errors."""
    missing = [k for k in ("input_size", "mean", "std", "crop_pct", "interpolation") if k not in meta]
    if missing:
        raise CheckpointError(f"{path} has no vitkit.{missing[0]} metadata: it was not written by `vitkit "
                              "export`, so its preprocessing is unknown; feed it prepared arrays instead")
    c, h, w = meta["input_size"]
    if len(meta["mean"]) < c or len(meta["std"]) < c:
        raise CheckpointError(f"{path}: its metadata has {len(meta['mean'])} mean and {len(meta['std'])} std values "
                              f"for {c} input channels")
    image = image.convert("L" if c == 1 else "RGB")
    if "max_patches" in meta and "patch_size" in meta:  # trained packed: whole, at its aspect ratio
        h, w = budget_size(image.height, image.width, meta["patch_size"], meta["max_patches"])
        image = image.resize((w, h), INTERPOLATION.get(meta["interpolation"], 2))
    elif meta.get("crop_mode", "center") == "squash":  # the whole image, resized to (H, W)
        image = image.resize((w, h), INTERPOLATION.get(meta["interpolation"], 2))
    else:
        image = resize_and_crop(image, (h, w), meta["crop_pct"], meta["interpolation"])
    x = np.asarray(image, dtype=np.float32).reshape(h, w, c).transpose(2, 0, 1) / 255.0
    mean = np.asarray(meta["mean"][:c], dtype=np.float32).reshape(c, 1, 1)
    std = np.asarray(meta["std"][:c], dtype=np.float32).reshape(c, 1, 1)
    return ((x - mean) / std)[None].astype(np.float32)


class OnnxModel:
    """An exported classifier in onnxruntime (CPU), with its preprocessing from the file's metadata.

    Calling it checks the input against the exported shape and dtype and names what was expected."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 4  # what onnxruntime would log about a damaged graph, vitkit's error says once
        self.path = str(path)
        try:  # onnxruntime's own error types for a missing, damaged or foreign file
            self.session = ort.InferenceSession(self.path, opts, providers=["CPUExecutionProvider"])
            meta = self.session.get_modelmeta().custom_metadata_map
            self.input = self.session.get_inputs()[0]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.path} is not an ONNX model onnxruntime can load: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        self.meta = read_metadata(self.path, meta)
        self.name = meta.get("vitkit.model", Path(self.path).stem)
        self.packed = bool(self.meta.get("packed"))  # inputs patches, image, index, grids (deploy/export_packed.py)
        if self.packed and not {"patch_size", "prefix"} <= self.meta.keys():
            raise CheckpointError(f"{self.path} takes packed batches but records no vitkit.patch_size and "
                                  "vitkit.prefix metadata: re-export it with `vitkit export --packed`")

    @property
    def labels(self) -> list[str] | None:
        return self.meta.get("labels")

    @property
    def thresholds(self) -> list[float] | None:
        """A multi-label classifier's per-class thresholds (its outputs take a sigmoid each), or None."""
        return self.meta.get("thresholds")

    def expected(self) -> str:
        c, h, w = self.meta.get("input_size", [None, None, None])
        if self.meta.get("dynamic_size"):
            k = self.meta.get("size_multiple", 1)
            h0, w0 = self.meta.get("min_size", [k, k])  # files from before min_size: one multiple
            if (h0, w0) == (k, k):  # a multiple is at least one
                sizes = f"H and W multiples of {k}"
            else:
                sizes = f"H >= {h0} and W >= {w0}" + (f", multiples of {k}" if k > 1 else "")
            return f"(B, {c}, H, W) float32 with {sizes} (exported at {h}x{w})"
        return f"(B, {c}, {h}, {w}) float32"

    def __call__(self, x) -> np.ndarray:
        """``x``: a float32 array (or a torch tensor) of the exported shape."""
        x = self._checked(x)
        if self.packed:  # each image one sequence of its own
            return self.run_packed(*pack_arrays(x, self.meta["patch_size"], self.meta["prefix"]))
        return self._run({self.input.name: x}, tuple(x.shape))

    def _checked(self, x) -> np.ndarray:
        """``x`` as a numpy array, or one line naming the shape and dtype the file expects."""
        if hasattr(x, "detach"):  # a torch tensor, taken without importing torch
            x = x.detach().cpu().numpy()
        c, h, w = self.meta.get("input_size", [x.shape[1] if x.ndim == 4 else None, None, None])
        k = self.meta.get("size_multiple", 1)
        h0, w0 = self.meta.get("min_size", [k, k])
        if not self.meta.get("dynamic_size"):
            ok_size = x.ndim == 4 and tuple(x.shape[2:]) == (h, w)
        else:
            ok_size = x.ndim == 4 and all(n % k == 0 and n >= lo for n, lo in zip(x.shape[2:], (h0, w0), strict=True))
        if x.dtype != np.float32:
            raise UsageTypeError(f"{self.path} expects {self.expected()}, got dtype {x.dtype}; normalise the pixels "
                                 "with the model's mean/std (OnnxModel.preprocess does) and pass float32")
        if x.ndim != 4 or x.shape[1] != c or not ok_size or x.shape[0] == 0:
            raise UsageError(f"{self.path} expects {self.expected()}, got shape {tuple(x.shape)}")
        return x

    def run_packed(self, patches: np.ndarray, image: np.ndarray, index: np.ndarray, grids: np.ndarray) -> np.ndarray:
        """A packed export (``vitkit export --packed``) on a packed batch (``models.packing.PackedBatch``'s fields:
        patches (S, L, P) float32, image and index (S, L) int64, grids (images, 2) int64) -> logits (images,
        classes), in image order."""
        if not self.packed:
            raise UsageError(f"{self.path} takes images {self.expected()}, not packed batches: export with --packed")
        arrays = {"patches": patches, "image": image, "index": index, "grids": grids}
        want = {"patches": (3, np.float32), "image": (2, np.int64), "index": (2, np.int64), "grids": (2, np.int64)}
        ok = all(a.ndim == want[k][0] and a.dtype == want[k][1] for k, a in arrays.items()) and \
            patches.shape[:2] == image.shape == index.shape and grids.shape[-1] == 2 and len(grids) > 0 and \
            int(image.max(initial=-1)) < len(grids)
        if not ok:
            got = ", ".join(f"{k} {tuple(a.shape)} {a.dtype}" for k, a in arrays.items())
            raise UsageError(f"{self.path} expects patches (S, L, P) float32, image and index (S, L) int64 (image ids "
                             f"below the number of grids) and grids (images, 2) int64; got {got}")
        shown, cells = image >= 0, grids.prod(-1)[image.clip(0)]  # each slot's image's patch count
        if image.min(initial=0) < -1 or grids.min() < 1 or (index[~shown] != -1).any() or \
                (index[shown] < 0).any() or (index[shown] >= self.meta["prefix"] + cells[shown]).any():
            raise UsageError(f"{self.path}: a packed batch's image ids are -1 (padding) or below {len(grids)}, its "
                             f"grids positive, and each slot's index -1 for padding, else below its image's "
                             f"{self.meta['prefix']} prefix token(s) and rows x columns patches (models.packing.pack "
                             "writes them so); these are not")
        return self._run({k: np.ascontiguousarray(v) for k, v in arrays.items()}, tuple(patches.shape))

    def outputs(self, x: np.ndarray) -> list[np.ndarray]:
        """Every output of a model with several (a detector's boxes, scores and labels), in the exported order, for a
        float32 input (B, C, H, W) checked as ``__call__`` checks it."""
        x = self._checked(x)
        return self._run({self.input.name: x}, tuple(x.shape), every=True)

    def _run(self, feed: dict[str, np.ndarray], shape: tuple[int, ...], every: bool = False):
        try:
            out = self.session.run(None, feed)
            return out if every else out[0]
        except Exception as e:  # noqa: BLE001 - the input passed the checks: the graph (or a packed feed) is at fault
            raise CheckpointError(f"{self.path}: onnxruntime could not run the model on an input of shape "
                                  f"{shape}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from None

    def preprocess(self, image) -> np.ndarray:
        """A PIL image -> the (1, C, H, W) float32 input, with the eval transform the metadata records
        (:func:`preprocess_image`)."""
        return preprocess_image(image, self.meta, self.path)

    def segment(self, image, mode: str = "whole", stride: tuple[int, int] | None = None) -> np.ndarray:
        """A segmenter's class for each pixel of a PIL image (H, W), as ``vitkit predict`` computes it with the
        PyTorch model: ``whole``, the image resized to the exported size (bilinear) and normalised, the logits
        resized back to the image's size (bilinear) before the argmax; ``slide``, windows of the exported size over
        the image as it is, ``stride`` apart, the logits of overlapping windows averaged (``vitkit/masks.py``)."""
        from PIL import Image

        from vitkit.masks import mask_of, slide_logits

        c, h, w = self.meta["input_size"]
        rgb = image.convert("RGB")
        rgb = np.asarray(rgb.resize((w, h), Image.BILINEAR) if mode == "whole" else rgb, dtype=np.float32) / 255.0
        mean = np.asarray(self.meta["mean"][:c], dtype=np.float32)
        std = np.asarray(self.meta["std"][:c], dtype=np.float32)
        x = ((rgb - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)
        if mode == "whole":
            return mask_of(self(x)[0], (image.height, image.width))
        return slide_logits(self, x, (h, w), stride)[0].argmax(0)


def pack_arrays(x: np.ndarray, patch_size: int, prefix: int) -> tuple[np.ndarray, ...]:
    """Images (B, C, H, W) of one size, H and W multiples of ``patch_size``, as a packed batch of one image a
    sequence in numpy (``models.packing.pack``'s layout: ``prefix`` empty slots, then the patches row by row, each
    channel-major)."""
    B, C, H, W = x.shape
    rows, cols, p = H // patch_size, W // patch_size, patch_size
    patches = x.reshape(B, C, rows, p, cols, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, rows * cols, C * p * p)
    patches = np.concatenate([np.zeros((B, prefix, C * p * p), np.float32), patches], axis=1)
    image = np.repeat(np.arange(B, dtype=np.int64)[:, None], prefix + rows * cols, axis=1)
    index = np.repeat(np.arange(prefix + rows * cols, dtype=np.int64)[None], B, axis=0)
    return patches, image, index, np.tile(np.array([[rows, cols]], np.int64), (B, 1))


INTERPOLATION = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}  # PIL's numbers


def resize_and_crop(image, size: tuple[int, int], crop_pct: float, interpolation: str):
    """timm's eval geometry on a PIL image, as torchvision computes it: the shorter side resized to
    floor(size / crop_pct) keeping the aspect ratio (both sides to floor(size / crop_pct) for a non-square
    size), then the centre ``size`` crop."""
    from PIL import Image

    h, w = size
    sh, sw = math.floor(h / crop_pct), math.floor(w / crop_pct)
    iw, ih = image.size
    if sh == sw:  # torchvision's Resize(int): the shorter side to sh, the longer in proportion (truncated)
        new = (sh, int(sh * ih / iw)) if iw <= ih else (int(sh * iw / ih), sh)
    else:  # timm's ResizeKeepRatio: the scale that makes the image cover (sh, sw)
        ratio = min(ih / sh, iw / sw)
        new = (round(iw / ratio), round(ih / ratio))
    resample = INTERPOLATION.get(interpolation, Image.BILINEAR)
    if new != (iw, ih):
        image = image.resize(new, resample)
    iw, ih = image.size
    top, left = int(round((ih - h) / 2.0)), int(round((iw - w) / 2.0))
    return image.crop((left, top, left + w, top + h))
