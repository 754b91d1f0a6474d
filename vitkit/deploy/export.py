"""Deploy what was trained: ONNX files checked against onnxruntime, and ``torch.export`` programs (.pt2).

An ONNX export carries what a consumer needs to feed the model: the input size, mean, std, crop_pct and
interpolation of its eval transform and its label names, as metadata (``vitkit.*`` keys). Every export is run
once against PyTorch on random input (two batch sizes, and another image size when sizes are dynamic) and
fails if the outputs differ by more than ``atol`` (relative to an output's largest magnitude where that is above 1).

A segmenter (``vitkit.models.segmentation``) exports as its backbone does, its output (B, classes, H, W) and its
metadata ``vitkit.task: segmentation``; UperNet's pooling pyramid computes its bins from each input's size
(``models.segmentation.AdaptiveAvgPool``), so it exports at any height and width too.

Axes: the batch is always dynamic, and so are height and width unless asked otherwise:
- ViT resamples its positions to each input's patch grid (timm's ``dynamic_img_size``); any multiple of the patch.
- Swin pads each stage's map to whole windows and builds its shift masks and token gathers in the graph from
  the input size; any size from the one where every stage's map still holds one whole window (193 for Swin-T at
  224) up. A smaller map would shrink the window, which changes the model, not only its sizes.
- A ViT with token merging exports at its own size by default (``dynamic_size=True`` exports any size, correctly,
  but the exporter's symbolic token counts make the export itself slow, the more so the deeper the model).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitkit.errors import UsageError
from vitkit.models.config import pair
from vitkit.models.registry import FAMILIES

from .onnx_model import OnnxModel, read_metadata  # noqa: F401 - OnnxModel: vitkit.deploy.export's name too

OPSET = 18
ATOL = 1e-4
INPUT, OUTPUT = "images", "logits"
log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export that failed, naming the model and the step."""


@dataclass
class ExportReport:
    path: str
    format: str
    model: str
    input_shape: tuple[int, ...]  # of the example; dynamic axes below
    dynamic: list[str]
    checks: list[tuple[tuple[int, ...], float]] = field(default_factory=list)  # (input shape, max |diff|, relative
    # to the output's largest magnitude where that is above 1)

    @property
    def max_abs_diff(self) -> float:
        return max(d for _, d in self.checks)

    def __str__(self) -> str:
        checks = ", ".join(f"{tuple(s)}: {d:.2e}" for s, d in self.checks)
        return (f"{self.model} -> {self.path} ({self.format}); input {self.input_shape}, dynamic: "
                f"{', '.join(self.dynamic)}; max |diff| against PyTorch {checks}")


def metadata(model: nn.Module, dynamic_size: bool) -> dict[str, str]:
    """The eval preprocessing and labels of ``model``, as ONNX metadata (string values)."""
    cfg = model.cfg
    h, w = pair(cfg.img_size)
    return {"vitkit.model": model.name, "vitkit.input_size": json.dumps([cfg.in_chans, h, w]),
            "vitkit.dynamic_size": json.dumps(dynamic_size), "vitkit.size_multiple": json.dumps(_multiple(model)),
            "vitkit.min_size": json.dumps(list(min_size(model)) if dynamic_size else [h, w]),
            "vitkit.mean": json.dumps(list(cfg.mean)), "vitkit.std": json.dumps(list(cfg.std)),
            "vitkit.crop_pct": json.dumps(cfg.crop_pct), "vitkit.interpolation": cfg.interpolation,
            "vitkit.crop_mode": getattr(cfg, "crop_mode", "center"),
            "vitkit.labels": json.dumps(getattr(model, "class_names", None)),
            "vitkit.task": getattr(model, "task", "classification"),  # the task that reads the file back
            "vitkit.thresholds": json.dumps(_thresholds(model)), **_packed_budget(model, dynamic_size),
            **{f"vitkit.{k}": json.dumps(v) for k, v in getattr(model, "extra_metadata", {}).items()}}


def _packed_budget(model: nn.Module, dynamic_size: bool) -> dict[str, str]:
    """A model trained on packed batches, exported for any size: its patch budget and patch size, so that each image
    is resized whole within the budget at its aspect ratio, as the run evaluated it."""
    budget = getattr(model.cfg, "max_patches", None)
    if budget is None or not dynamic_size:
        return {}
    return {"vitkit.max_patches": json.dumps(budget), "vitkit.patch_size": json.dumps(_net(model).patch_size)}


def _thresholds(model: nn.Module) -> list[float] | None:
    """A multi-label classifier's thresholds (its outputs are sigmoids, one per class), or None (a softmax)."""
    values = getattr(model, "thresholds", None)
    return None if values is None else [float(t) for t in values]


def output_names(model: nn.Module) -> tuple[str, ...]:
    """The export's outputs: ``logits``, or a model's own (a detector's ``boxes``, ``scores``, ``labels``)."""
    return tuple(getattr(model, "output_names", (OUTPUT,)))


def _differ(got, expected) -> float:
    """The largest difference between the export's outputs and the model's, over every floating-point output (a
    detector's labels are the argmax of the scores compared here): absolute, and relative to the output's largest
    magnitude where that is above 1 (a metric depth map in metres, whose float32 rounding grows with it)."""
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        if e.is_floating_point():
            e = e.detach().double().cpu().numpy()
            scale = max(1.0, float(np.abs(e).max())) if e.size else 1.0
            worst = max(worst, float(np.abs(np.asarray(g, dtype=np.float64) - e).max()) / scale)
    return worst


def _net(model: nn.Module) -> nn.Module:
    """The network whose architecture decides the sizes an export takes: a segmenter's backbone, or the model."""
    return getattr(model, "backbone", model)


def export_sizes(model: nn.Module) -> str | None:
    """The sizes the family of the network an export takes its sizes from (``_net``) exports at
    (``Family.export_sizes``): "patch_multiples", "padded", or None where it does not export."""
    net = _net(model)
    own = sorted(FAMILIES.values(), key=lambda f: type(net) is not f.model)  # its own family before a parent's
    return next((f.export_sizes for f in own if isinstance(net, f.model)), None)


def padded(model: nn.Module) -> bool:
    """Whether the network pads any input size to its patches and windows (Swin) instead of taking multiples of the
    patch (ViT)."""
    return export_sizes(model) == "padded"


def _multiple(model: nn.Module) -> int:
    """What height and width must be a multiple of: what the model names (``size_multiple``: RF-DETR's patch times its
    windows, or the stride of the last Swin stage it reads), else the patch, or 1 where the network pads to it."""
    return int(getattr(model, "size_multiple", None) or (1 if padded(model) else model.cfg.patch_size))


def min_size(model: nn.Module) -> tuple[int, int]:
    """The smallest (H, W) a dynamic-size export takes: one patch for ViT, and for a Swin that keeps its windows at
    every size (``always_partition``: a smaller map is padded); for another Swin, the smallest size at which every
    stage's map is still at least its window (patch merging halves it, rounding up)."""
    p, m = int(model.cfg.patch_size), _multiple(model)
    if not padded(model) or getattr(model.cfg, "always_partition", False):
        return m, m

    def fits(size: int, axis: int) -> bool:
        n = -(-size // p)
        for i, stage in enumerate(_net(model).layers):
            n = n if i == 0 else -(-n // 2)
            if n < stage.window[axis]:
                return False
        return True

    return tuple(next(s for s in range(m, 1 << 16, m) if fits(s, axis)) for axis in (0, 1))


def prepare(model: nn.Module, dynamic_size: bool | None) -> tuple[nn.Module, bool]:
    """An eval, float32 copy on the CPU whose attention runs the reference path (matmul + softmax, what ONNX
    runs anyway; the fused SDPA node does not survive export's decomposition for windowed attention)."""
    kind = export_sizes(model)
    if kind is None:
        net = _net(model)
        own = sorted(FAMILIES.items(), key=lambda item: type(net) is not item[1].model)
        family = next((n for n, f in own if isinstance(net, f.model)), "another")
        raise ExportError(f"export takes ViT and Swin classifiers and segmenters; {model.name} is a {family} model "
                          f"({type(net).__name__}), whose family exports no ONNX")
    if dynamic_size is None:  # dynamic, except with token merging (see the module docstring): the exporter's
        # symbolic token counts nest each block's min(r, half the patches)
        dynamic_size = not getattr(_net(model), "merging", False)
    m = copy.deepcopy(model).float().cpu().eval()
    m.set_attn_backend("math")
    if kind == "patch_multiples":
        m.set_dynamic_img_size(dynamic_size)
    return m, dynamic_size


def _dims(model: nn.Module, dynamic_size: bool) -> tuple[dict[int, Any], list[str]]:
    batch = torch.export.Dim("batch", min=1, max=4096)
    if not dynamic_size:
        return {0: batch}, ["batch"]
    h, w = pair(model.cfg.img_size)
    names = ["batch", "height", "width"]
    (h0, w0), p = min_size(model), _multiple(model)
    if p == 1:  # any size from the smallest that keeps every stage's window
        return ({0: batch, 2: torch.export.Dim("height", min=h0, max=max(1024, 4 * h)),
                 3: torch.export.Dim("width", min=w0, max=max(1024, 4 * w))}, names)
    return ({0: batch, 2: p * torch.export.Dim("grid_h", min=h0 // p, max=max(64, 4 * h // p)),
             3: p * torch.export.Dim("grid_w", min=w0 // p, max=max(64, 4 * w // p))}, names)


def _tracing(model: nn.Module, dynamic_size: bool):
    """Swin with symbolic sizes traces reshapes whose sizes may be 1 (a stage of one window): size-oblivious
    reasoning keeps export from specialising them to the example's value (the graph is right for 1 too)."""
    import contextlib

    # size-oblivious tracing has no public switch (checked on torch 2.14.1; tests/layers/test_attention.py fails
    # if it disappears, and older torch gets the ExportError below)
    import torch.fx.experimental._config as fx_config

    if dynamic_size and padded(model):
        if not hasattr(fx_config, "backed_size_oblivious"):
            raise ExportError(f"{model.name}: dynamic height and width for Swin need a PyTorch with size-oblivious "
                              f"export (torch {torch.__version__} has none); export a fixed size (--fixed-size)")
        return fx_config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


def _check_inputs(model: nn.Module, dynamic_size: bool) -> list[torch.Tensor]:
    cfg, g = model.cfg, torch.Generator().manual_seed(0)
    h, w = pair(cfg.img_size)
    shapes = [(1, cfg.in_chans, h, w), (3, cfg.in_chans, h, w)]
    p = _multiple(model)
    if dynamic_size and p == 1:  # another, non-square size: one more row in the last stage (Swin-T at
        # 224 -> 257: the last stage now shifts), and a narrower width that every stage pads
        cell, w0 = cfg.patch_size * 2 ** (len(_net(model).layers) - 1), min_size(model)[1]
        shapes.append((2, cfg.in_chans, h + cell + 1, max(w0, w - cfg.patch_size - 1)))
    elif dynamic_size:  # another, non-square multiple of the patch (of what the model names)
        shapes.append((2, cfg.in_chans, h + 2 * p, max(min_size(model)[1], w - p)))
    return [torch.randn(s, generator=g) for s in shapes]


def _failed(model: nn.Module, what: str, e: Exception) -> ExportError:
    text = str(e)
    step = re.search(r"step (\d)/3", text)
    steps = {"1": "capturing the graph (torch.export)", "2": "decomposing the graph into ONNX-ready ops",
             "3": "translating the graph to ONNX"}
    where = steps.get(step.group(1), what) if step else what
    summary = re.search(r"## Exception summary\s*\n(.*?)(\n\n|$)", text, re.S)
    detail = summary.group(1).strip() if summary else f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return ExportError(f"exporting {model.name} failed while {where}: {detail}")


def _example(model: nn.Module, dynamic_size: bool | None):
    """The copy to export, whether its height and width are dynamic, the export's Dims and their names, and the
    example input (batch 2 at the model's size)."""
    m, dynamic_size = prepare(model, dynamic_size)
    dims, dynamic = _dims(m, dynamic_size)
    return m, dynamic_size, dims, dynamic, torch.randn(2, m.cfg.in_chans, *pair(m.cfg.img_size))


def export_onnx(model: nn.Module, path: str | os.PathLike, *, dynamic_size: bool | None = None, opset: int = OPSET,
                atol: float = ATOL) -> ExportReport:
    """Write ``model`` as ONNX (opset >= 18), batch, height and width dynamic (height and width fixed with
    ``dynamic_size=False``); check it with onnxruntime."""
    import onnx

    if opset < 18:
        raise UsageError(f"opset must be 18 or newer, got {opset}")
    m, dynamic_size, dims, dynamic, x = _example(model, dynamic_size)
    try:
        with _tracing(m, dynamic_size):
            program = torch.onnx.export(m, (x,), dynamo=True, dynamic_shapes=(dims,), opset_version=opset,
                                        input_names=[INPUT], output_names=list(output_names(m)), verbose=False)
    except Exception as e:  # noqa: BLE001 - torch.export and the ONNX exporter raise many kinds
        raise _failed(model, "exporting to ONNX", e) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    proto = program.model_proto
    for k, v in metadata(m, dynamic_size).items():
        proto.metadata_props.add(key=k, value=v)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(proto, str(tmp))
    report = ExportReport(str(path), "onnx", m.name, tuple(x.shape), dynamic)
    try:
        session = OnnxModel(tmp)
        with torch.no_grad():
            for xi in _check_inputs(m, dynamic_size):
                report.checks.append((tuple(xi.shape), _differ(session.outputs(xi.numpy()), m(xi))))
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        raise _failed(model, "running the export in onnxruntime", e) from None
    return _accept(report, tmp, atol, f"exporting {model.name}: onnxruntime and PyTorch")


def export_program(model: nn.Module, path: str | os.PathLike, *, dynamic_size: bool | None = None,
                   atol: float = ATOL) -> ExportReport:
    """Write ``model`` as a ``torch.export`` ExportedProgram (.pt2), with the ONNX export's metadata (preprocessing,
    labels, a multi-label model's thresholds) as the extra file ``vitkit.json``; check that it loads back and
    agrees."""
    m, dynamic_size, dims, dynamic, x = _example(model, dynamic_size)
    try:
        with _tracing(m, dynamic_size):
            program = torch.export.export(m, (x,), dynamic_shapes=(dims,))
    except Exception as e:  # noqa: BLE001
        raise _failed(model, "capturing the graph (torch.export)", e) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.pt2")  # torch.export.save wants the .pt2 ending
    torch.export.save(program, str(tmp), extra_files={PROGRAM_METADATA: json.dumps(metadata(m, dynamic_size))})
    report = ExportReport(str(path), "torch-export", m.name, tuple(x.shape), dynamic)
    loaded = torch.export.load(str(tmp)).module()
    with torch.no_grad():
        for xi in _check_inputs(m, dynamic_size):
            report.checks.append((tuple(xi.shape), _differ(loaded(xi), m(xi))))
    return _accept(report, tmp, atol, f"exporting {model.name}: the loaded program and the model")


PROGRAM_METADATA = "vitkit.json"  # a .pt2's extra file: metadata() of the model, as in an ONNX file


def read_program_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``vitkit.*`` metadata of a .pt2 written by :func:`export_program`, checked as an ONNX file's."""
    files = {PROGRAM_METADATA: ""}
    torch.export.load(str(path), extra_files=files)
    return read_metadata(str(path), json.loads(files[PROGRAM_METADATA] or "{}"))


def _accept(report: ExportReport, tmp: Path, atol: float, what: str) -> ExportReport:
    """Move the checked file into place, or delete it and fail when the check found a difference above atol."""
    if report.max_abs_diff > atol:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"{what} differ by {report.max_abs_diff:.2e} (> {atol:g}) on {report.checks}; "
                          "nothing was written")
    os.replace(tmp, report.path)
    return report


