"""int8 ONNX models: the linear layers quantized, calibrated on the user's images, gated on accuracy and timed.

``quantize_int8`` takes an fp32 file written by ``vitkit export`` and labelled images, which the task of the file
reads and scores (its ``int8_gate``, ``vitkit.tasks.protocol``): a classifier's are a folder per class, named as the
model's labels, scored by top-1 (:class:`TopOne`); a detector's a COCO, YOLO or VOC folder scored by COCO's AP50:95.
The images are preprocessed as the model's metadata says (the data module's eval transform) and the first
``calibration`` of a seeded order calibrate. The rest are held out: the fp32 and the int8 model are both scored there.

* ``static`` (the default): onnxruntime's QDQ quantization of the MatMul and Gemm nodes whose second input is a
  weight, per output channel, activations from the calibration images' ranges. The attention's two products (both
  inputs activations), the convolutions, softmax, LayerNorm and GELU stay in float, unless the gate's ``layers``
  names ``"attention"`` (those products) or ``"convolution"`` (the Conv nodes with weights but one that makes an
  output, whose int8 result would be the model's: 256 levels of depth): a depth model's gate names both, its DPT
  head being convolutions at up to the image's size and its attention over many tokens.
* ``dynamic``: the same weights in int8, each activation quantized as it comes; no calibration ranges.

The file is written only when the int8 model loses at most ``max_drop`` points of the gate's score (the gate's own
default where not given) on the held-out images.
Otherwise the refusal gives the two scores and names the layers that add the most error. The error of a
layer is its output's relative error under int8 minus its input's, both measured on held-out images. Those layers
stay float with ``keep`` (patterns matched against the node names). Both models are also timed at batch 1 in the
same process; the report says when int8 is not faster.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vitkit.errors import UsageError
from vitkit.image_files import is_image_file

from .onnx_model import OnnxModel

log = logging.getLogger(__name__)

MODES = ("static", "dynamic")
METHODS = ("minmax", "entropy", "percentile")
MIN_HELD_OUT = 100  # images the gate scores: 0.5 points is then one image in 200 at most
MIN_CALIBRATION = 16  # the fewest calibration images a refusal suggests


class QuantizationRefused(UsageError):
    """The int8 model lost more than allowed, or the input cannot be calibrated on; nothing was written."""


@dataclass
class Int8Report:
    path: str
    mode: str
    calibrated: int
    held_out: int
    fp32_score: float
    int8_score: float
    quantized: int
    kept: list[str] = field(default_factory=list)
    fp32_ms: float = 0.0
    int8_ms: float = 0.0
    runtime: str = "onnxruntime"  # what the times were measured in
    metric: str = "top-1"  # the gate's score
    lower_better: bool = False  # an error (a depth model's AbsRel): the drop is in percent of fp32's
    kinds: dict[str, int] = field(default_factory=dict)  # the quantized layers of each kind, where not all linear

    @property
    def drop(self) -> float:
        """Points of the score lost on the held-out images; for an error, how many percent int8's is above fp32's."""
        if self.lower_better:
            return 100 * (self.int8_score - self.fp32_score) / max(self.fp32_score, 1e-12)
        return 100 * (self.fp32_score - self.int8_score)

    @property
    def lost(self) -> str:
        """The drop in words."""
        if self.lower_better:
            return f"{abs(self.drop):.2f} % {'worse' if self.drop >= 0 else 'better'}"
        return f"{abs(self.drop):.2f} points {'lost' if self.drop >= 0 else 'gained'}"

    def __str__(self) -> str:
        speed = self.fp32_ms / self.int8_ms if self.int8_ms else float("nan")
        names = {"linear": "linear layers", "convolution": "convolutions", "attention": "attention products"}
        layers = (", ".join(f"{n} {names[k]}" for k, n in self.kinds.items() if n) if self.kinds
                  else f"{self.quantized} linear layers")
        lines = [f"{self.path}: int8 ({self.mode}), {layers} quantized"
                 + (f", {len(self.kept)} kept in float" if self.kept else "")
                 + f"; calibrated on {self.calibrated} images",
                 f"{self.metric} on {self.held_out} held-out images: fp32 {self.fp32_score:.4f}, int8 "
                 f"{self.int8_score:.4f} ({self.lost})",
                 f"batch 1 on this CPU ({self.runtime}): fp32 {self.fp32_ms:.2f} ms, int8 {self.int8_ms:.2f} ms "
                 f"({speed:.2f}x)"]
        if self.fp32_score < 0.01 and not self.lower_better:
            lines.append(f"the fp32 model scores {self.fp32_score:.4f} on the held-out images, so the gate compares "
                         "next to nothing: check that the calibration images are of the model's task and classes")
        if speed < 1.0:
            other = "--int8 dynamic" if self.runtime == "onnxruntime" else "the ONNX export's --int8 (and dynamic)"
            lines.append(f"int8 is not faster than fp32 on this CPU: keep the fp32 file here, or try {other} "
                         "(int8 pays on large layers, and most on CPUs with VNNI or AMX)")
        return "\n".join(lines)


def labelled_images(folder: str | os.PathLike, labels: list[str] | None) -> list[tuple[Path, int]]:
    """(image, class index) of every image under ``folder/<class>/`` (or ``folder/val/<class>/`` where there is one),
    the classes named as the model's ``labels``."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise QuantizationRefused(f"--calibrate {folder}: not a folder (expected one folder of images per class)")
    if (root / "val").is_dir():
        root = root / "val"
    if not labels:
        raise QuantizationRefused("the model records no class names (no vitkit.labels metadata): int8 calibration "
                                  "scores a classifier, so export one trained with its data's classes")
    index = {name: i for i, name in enumerate(labels)}
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    unknown = [c for c in classes if c not in index]
    if not classes or unknown:
        raise QuantizationRefused(f"--calibrate {root}: expected one folder per class named as the model's labels "
                                  f"({', '.join(labels[:5])}{', ...' if len(labels) > 5 else ''}), found "
                                  f"{', '.join(unknown or classes) or 'no folders'}")
    return [(p, index[c]) for c in classes for p in sorted((root / c).iterdir()) if is_image_file(p)]


def layer_kinds(model) -> dict[str, str]:
    """Each quantizable node of an ONNX graph by name -> its kind: ``linear`` (a MatMul or Gemm whose second input is
    a weight, an initializer), ``convolution`` (a Conv with a weight, but one that makes an output:
    :func:`output_layers`) or ``attention`` (a MatMul of two activations: the attention's products)."""
    weights = {t.name for t in model.graph.initializer}
    last = output_layers(model, weights)
    kinds = {}
    for n in model.graph.node:
        weighted = len(n.input) > 1 and n.input[1] in weights
        if n.op_type in ("MatMul", "Gemm") and weighted:
            kinds[n.name] = "linear"
        elif n.op_type == "Conv" and weighted and n.name not in last:  # its output would be int8: the model's own
            kinds[n.name] = "convolution"
        elif n.op_type == "MatMul":
            kinds[n.name] = "attention"
    return kinds


def output_layers(model, weights: set[str]) -> set[str]:
    """The weighted nodes (MatMul, Gemm, Conv) whose results reach a graph output through no other weighted node: the
    layers that make the model's outputs (a depth head's last convolution; not a layer whose shape alone is read)."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    found, seen, tensors = set(), set(), [o.name for o in model.graph.output]
    while tensors:
        node = made_by.get(tensors.pop())
        if node is None or node.name in seen or node.op_type == "Shape":
            continue
        seen.add(node.name)
        if node.op_type in ("MatMul", "Gemm", "Conv") and len(node.input) > 1 and node.input[1] in weights:
            found.add(node.name)
        else:
            tensors.extend(node.input)
    return found


def linear_nodes(model, layers: tuple[str, ...] = ("linear",)) -> list[str]:
    """The names of the nodes of an ONNX graph of the ``layers`` kinds (:func:`layer_kinds`): by default the linear
    layers, not the attention's products of two activations."""
    return [n for n, kind in layer_kinds(model).items() if kind in layers]


def module_names(model) -> dict[str, str]:
    """Each node's PyTorch module (``blocks.11.mlp.fc2``), where the exporter recorded its name scopes; else the
    node's own name."""
    import ast

    names = {}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        try:
            parts = [s for s in ast.literal_eval(scopes) if s] if scopes else []
        except (ValueError, SyntaxError):
            parts = []
        names[node.name] = parts[-2] if len(parts) > 1 else node.name  # the last scope is the op itself
    return names


class CalibrationBatches:
    """onnxruntime's CalibrationDataReader: the calibration images, one batch at a time."""

    def __init__(self, name: str, arrays: Inputs, batch: int = 8) -> None:
        self.items = iter([{name: b} for b in in_batches(arrays, batch)])

    def get_next(self):
        return next(self.items, None)


Inputs = np.ndarray | list[np.ndarray]  # (N, C, H, W), or N arrays (1, C, H, W) of their own sizes


def in_batches(x: Inputs, batch: int) -> list[np.ndarray]:
    """``x`` in batches of ``batch``; images of their own sizes (a list) one to a batch."""
    return [x[i:i + batch] for i in range(0, len(x), batch)] if isinstance(x, np.ndarray) else list(x)


def _inputs(preprocess, images: list[tuple[Path, int]]) -> tuple[Inputs, np.ndarray]:
    """The images as the model's inputs (``preprocess``: a PIL image -> (1, C, H, W)), and their labels; a file PIL
    cannot read is left out, with a warning. Images that ``preprocess`` leaves at their own sizes (a model that takes
    each image whole within a patch budget) stay apart, each (1, C, H, W)."""
    from PIL import Image

    arrays, targets, unreadable = [], [], []
    for path, label in images:
        try:
            with Image.open(path) as image:
                arrays.append(preprocess(image)[0])
        except OSError:  # PIL's UnidentifiedImageError and truncated files
            unreadable.append(path)
            continue
        targets.append(label)
    if unreadable:
        log.warning("left out %d unreadable image(s) of the calibration folder, e.g. %s", len(unreadable),
                    unreadable[0])
    if len({a.shape for a in arrays}) > 1:
        return [a[None] for a in arrays], np.asarray(targets)
    return np.stack(arrays), np.asarray(targets)


def enough_images(calibrate, count: int, calibration: int, gate: str, where: str = "") -> None:
    """Refuse, in one line, a calibration folder of ``count`` images (``where``: which of them, "in its val split")
    that cannot give ``calibration`` to calibrate and ``MIN_HELD_OUT`` to score; say the size that fits it."""
    if count >= calibration + MIN_HELD_OUT:
        return
    fits = (f"; --calibration-size {count - MIN_HELD_OUT} fits these" if count - MIN_HELD_OUT >= MIN_CALIBRATION
            else f"; give it at least {MIN_CALIBRATION + MIN_HELD_OUT}")
    raise QuantizationRefused(f"--calibrate {calibrate} holds {count} images{where}; {calibration} to calibrate "
                              f"(--calibration-size) and {MIN_HELD_OUT} held out for the {gate} need "
                              f"{calibration + MIN_HELD_OUT}{fits}")


def calibration_set(calibrate: str | os.PathLike, labels: list[str] | None, preprocess, calibration: int,
                    seed: int = 0) -> tuple[Inputs, np.ndarray]:
    """The labelled images of ``calibrate`` as inputs and labels, in a seeded order: the first ``calibration``
    calibrate, the rest (``MIN_HELD_OUT`` or more) are held out for the accuracy gate."""
    images = labelled_images(calibrate, labels)
    enough_images(calibrate, len(images), calibration, "accuracy gate")
    order = np.random.default_rng(seed).permutation(len(images))
    x, y = _inputs(preprocess, [images[k] for k in order])
    if len(y) < calibration + MIN_HELD_OUT:
        raise QuantizationRefused(f"--calibrate {calibrate} holds {len(y)} readable images; {calibration} to "
                                  f"calibrate and {MIN_HELD_OUT} held out need {calibration + MIN_HELD_OUT}")
    return x, y


def top1(model, x: Inputs, y: np.ndarray, batch: int = 16) -> float:
    """Top-1 of ``model`` (a function of float32 arrays: an ``OnnxModel``) on ``x`` and labels ``y``."""
    preds = np.concatenate([model(b).argmax(1) for b in in_batches(x, batch)])
    return float((preds == y).mean())


class Held(NamedTuple):
    """A gate's held-out images: the model's inputs, what the gate scores them against, and their count."""

    x: Inputs
    truth: Any
    count: int


class TopOne:
    """A classifier's int8 gate (the classification task's ``int8_gate``): a folder of images per class, named as
    the model's labels (``DIR/val/<class>`` where there is one), scored by top-1."""

    metric, key, max_drop = "top-1", "top1", 0.5

    def __init__(self, base: OnnxModel) -> None:
        if base.thresholds is not None:
            raise QuantizationRefused(f"{base.path} is not a single-label classifier: int8 export scores top-1 on "
                                      "labelled images, which a multi-label model does not have")
        self.base = base

    def inputs(self, calibrate: str | os.PathLike, calibration: int, seed: int) -> tuple[Inputs, Held]:
        """The calibration inputs and the held-out images."""
        x, y = calibration_set(calibrate, self.base.labels, self.base.preprocess, calibration, seed)
        return x[:calibration], Held(x[calibration:], y[calibration:], len(y) - calibration)

    def score(self, model, held: Held) -> float:
        return top1(model, held.x, held.truth)


def batch1_ms(models: list, x: Inputs, rounds: int = 5, runs: int = 10) -> list[float]:
    """Median ms of one batch-1 call of each model (on the first image), measured in interleaved rounds (after a
    warm-up)."""
    times: list[list[float]] = [[] for _ in models]
    one = in_batches(x, 1)[0]
    for m in models:
        m(one)
    for _ in range(rounds):
        for k, m in enumerate(models):
            start = time.perf_counter()
            for _ in range(runs):
                m(one)
            times[k].append(1000 * (time.perf_counter() - start) / runs)
    return [statistics.median(t) for t in times]


def int8_fixed_size(model) -> bool:
    """Whether ``model``'s int8 export is written at its own size: a padded one's (Swin), whose shifted-window masks
    and gathers are then constants instead of float work in every block (a ViT's dynamic graph runs as fast as its
    fixed one)."""
    from .export import padded

    return padded(model)


def write_int8(src: str, dst: Path, mode: str, reader, nodes: list[str], method: str) -> None:
    """Quantize ``src`` into ``dst``: the ``nodes`` named, in ``mode``, calibrated by ``reader`` where static."""
    shaped = dst.with_name(dst.name + ".shapes")
    try:  # the shapes onnxruntime's quantizer asks for (its pre-processing without the graph optimisation, which
        # would rename the nodes): a graph it cannot infer is quantized as it is
        import contextlib
        import tempfile

        from onnxruntime.quantization.shape_inference import quant_pre_process

        # its symbolic shape inference writes a temporary model and its weights into the working directory
        with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            quant_pre_process(os.path.abspath(src), str(shaped.absolute()), skip_optimization=True)
        src = str(shaped)
    except Exception:  # noqa: BLE001
        pass
    try:
        _quantize(src, dst, mode, reader, nodes, method)
    finally:
        shaped.unlink(missing_ok=True)


def _quantize(src: str, dst: Path, mode: str, reader, nodes: list[str], method: str) -> None:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if mode == "dynamic":
        quantize_dynamic(src, str(dst), op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=nodes,
                         per_channel=True, weight_type=QuantType.QInt8)
        return
    calibrate = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                 "percentile": CalibrationMethod.Percentile}[method]
    # uint8 inputs and int8 weights (the u8s8 kernels dynamic int8 runs too); each layer's output is left in float,
    # where its bias, the residual and the next norm take it, instead of being quantized again and dequantized at once.
    # A convolution's output is quantized: onnxruntime fuses a Conv into its int8 kernel (QLinearConv) only then
    quantize_static(src, str(dst), reader, quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul", "Gemm", "Conv"], nodes_to_quantize=nodes, per_channel=True,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, calibrate_method=calibrate,
                    extra_options={"OpTypesToExcludeOutputQuantization": ["MatMul", "Gemm"]})


def _carry_metadata(src, dst: Path, extra: dict) -> None:
    """The fp32 file's ``vitkit.*`` metadata (preprocessing, labels, thresholds) into the int8 file, and ``extra``."""
    import onnx

    model = onnx.load(str(dst))
    del model.metadata_props[:]
    for prop in src.metadata_props:
        model.metadata_props.add(key=prop.key, value=prop.value)
    model.metadata_props.add(key="vitkit.int8", value=json.dumps(extra))
    onnx.save(model, str(dst))


def quantize_int8(fp32: str | os.PathLike, out: str | os.PathLike, calibrate: str | os.PathLike, *,
                  mode: str = "static", calibration: int = 200, max_drop: float | None = None,
                  keep: tuple[str, ...] = (), method: str = "minmax", seed: int = 0, gate=TopOne) -> Int8Report:
    """Write the int8 model of the fp32 file ``fp32`` to ``out``, or refuse (see the module docstring). ``gate``:
    (the fp32 ``OnnxModel``) -> what scores fp32 against int8 (its task's ``int8_gate``; :class:`TopOne`'s
    interface)."""
    import onnx

    if mode not in MODES or method not in METHODS:
        raise QuantizationRefused(f"--int8 takes {' or '.join(MODES)} and --calibration-method one of "
                                  f"{', '.join(METHODS)}, got {mode!r} and {method!r}")
    base = OnnxModel(fp32)
    gate = gate(base)
    max_drop = gate.max_drop if max_drop is None else max_drop
    x, held = gate.inputs(calibrate, calibration, seed)
    proto = onnx.load(str(fp32))
    # the dynamic mode quantizes the linear layers alone (onnxruntime's dynamic convolution is slower than float)
    layers = tuple(getattr(gate, "layers", ("linear",))) if mode == "static" else ("linear",)
    kinds, module = layer_kinds(proto), module_names(proto)
    linear = [n for n, kind in kinds.items() if kind in layers]
    kept = [n for n in linear if any(fnmatch.fnmatch(module[n], p) or fnmatch.fnmatch(n, p) for p in keep)]
    if keep and not kept:
        raise QuantizationRefused(f"--keep-fp32 {' '.join(keep)} matches no quantized layer; their names look like "
                                  f"{', '.join(module[n] for n in linear[:3])} (patterns as fnmatch's: "
                                  "'*blocks.11.*', '*.fc2', 'head.*')")
    out, quantized = Path(out), [n for n in linear if n not in kept]
    tmp = out.with_name(out.name + ".int8.tmp")
    try:
        write_int8(str(fp32), tmp, mode, CalibrationBatches(base.input.name, x), quantized, method)
        int8 = OnnxModel(tmp)
        report = Int8Report(str(out), mode, calibration, held.count, gate.score(base, held), gate.score(int8, held),
                            len(quantized), [module[n] for n in kept], metric=gate.metric,
                            lower_better=getattr(gate, "lower_better", False),
                            kinds={} if layers == ("linear",) else
                            {k: sum(kinds[n] == k for n in quantized) for k in layers})
        if report.drop > max_drop:
            errors = layer_errors(fp32, tmp, quantized, held.x[:16])
            raise refusal(report, max_drop, [(module[n], e) for n, e in errors])
        report.fp32_ms, report.int8_ms = batch1_ms([base, int8], held.x)
        _carry_metadata(proto, tmp, {"mode": mode, "calibrated": calibration, "held_out": report.held_out,
                                     f"fp32_{gate.key}": report.fp32_score, f"int8_{gate.key}": report.int8_score,
                                     "kept": [module[n] for n in kept],
                                     "layers": report.kinds or {"linear": report.quantized}})
        os.replace(tmp, out)
        return report
    finally:
        tmp.unlink(missing_ok=True)


def refusal(report: Int8Report, max_drop: float, errors: list[tuple[str, float]]) -> QuantizationRefused:
    """The gate's one line: the two scores, and the layers (``errors``: module name and added error, largest first)
    that add the most error."""
    worst = [e for e in errors if e[1] > 0][:5] or errors[:3]
    loses = f"int8's {report.metric} is {report.drop:.2f} % worse" if report.lower_better else \
        f"int8 loses {report.drop:.2f} points of {report.metric}"
    return QuantizationRefused(
        f"{loses} (fp32 {report.fp32_score:.4f}, int8 "
        f"{report.int8_score:.4f} on "
        f"{report.held_out} held-out images), more than --max-drop {max_drop:g}; nothing was written. The layers that "
        "add the most error: " + ", ".join(f"{name} ({e:.3f})" for name, e in worst)
        + "; keep them in float with --keep-fp32 PATTERN")


def layer_errors(fp32: str | os.PathLike, int8: str | os.PathLike, nodes: list[str],
                 x: Inputs) -> list[tuple[str, float]]:
    """Each linear layer's added error, largest first: the relative error of its output in the int8 model (against
    the fp32 model's, on ``x``) minus that of its input."""
    import onnx
    import onnxruntime as ort

    reference = onnx.load(str(fp32))
    tensors = {n.name: (n.input[0], n.output[0]) for n in reference.graph.node if n.name in nodes}
    wanted = sorted({t for pair in tensors.values() for t in pair})

    def run(path) -> dict[str, np.ndarray]:
        model = onnx.load(str(path))
        present = {o.name for o in model.graph.output}
        for name in wanted:
            if name not in present:
                model.graph.output.add(name=name)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        runs = [session.run(None, {session.get_inputs()[0].name: b}) for b in in_batches(x, len(x))]
        return {k: np.concatenate([r[j].ravel() for r in runs]) for j, k in enumerate(names) if k in wanted}

    a, b = run(fp32), run(int8)

    def rel(t: str) -> float:
        return float(np.linalg.norm(b[t] - a[t]) / max(np.linalg.norm(a[t]), 1e-12)) if t in a and t in b else 0.0

    return sorted(((n, rel(o) - rel(i)) for n, (i, o) in tensors.items()), key=lambda e: -e[1])
