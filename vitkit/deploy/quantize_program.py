"""int8 ``torch.export`` programs (.pt2) through PyTorch's x86 quantizer: ``vitkit export --format torch-export
--int8``, beside the ONNX files of ``quantize.py``.

torchao's pt2e flow with its ``X86InductorQuantizer``: the model is captured by ``torch.export`` at its own size
(any batch), its linear layers get static int8 (uint8 activations per tensor from the calibration images' ranges,
int8 weights per output channel), and the program is written with those quantize/dequantize pairs. The patch
embedding, softmax, LayerNorm, GELU and the attention's products stay in float, as in the ONNX file.
``torch.compile`` with frozen weights (:func:`load_int8_program`) turns each pair and its layer into one int8 kernel
(oneDNN) and calls the kernels from C++ (inductor's C++ wrapper); run eagerly, the program gives the same numbers
slowly.

The calibration, the held-out accuracy gate, ``--keep-fp32`` and the refusal that names the layers adding the most
error are the ONNX path's. On a CPU with native bf16 (AVX512-BF16, AMX) the float operations between the int8
products run in bf16 (autocast), as OpenVINO runs them by default; the gate scores the program so, and
:class:`Int8Program` runs it so. On a CPU without VNNI or AMX the compiled program computes in float after each
dequantize (:func:`int8_kernels`). The times are those of the two programs compiled, at batch 1.

``load_int8_program(path, autotune=True)`` compiles with inductor's max-autotune: each int8 product is timed as
oneDNN's kernel and as inductor's own C++ GEMM (which takes the epilogue after it into the same loop), and the faster
runs. That pays where the products are many and small (a Swin at batch 1), and costs minutes on the first load;
later loads on the machine reuse inductor's cache.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitkit.errors import CheckpointError
from vitkit.layers.kernels import cpu_has_bf16_matmul, cpu_has_int8_dot

from .export import PROGRAM_METADATA, metadata, prepare
from .onnx_model import preprocess_image, read_metadata
from .quantize import Int8Report, QuantizationRefused, batch1_ms, calibration_set, refusal, top1

INSTALL = "pip install 'vitkit[int8]'"
# inductor's C++ wrapper: the program's calls from C++, not from Python (on a ViT, hundreds of kernel calls a forward)
COMPILE_OPTIONS = {"cpp_wrapper": True}
# max-autotune: each int8 product timed as oneDNN's kernel (ATEN) and as inductor's C++ GEMM template (CPP), without
# a table of the timings on stderr for every product
AUTOTUNE_OPTIONS = {**COMPILE_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def _torchao():
    """torchao's pt2e entry points: (X86InductorQuantizer's module, prepare_pt2e, convert_pt2e)."""
    try:
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    except ImportError as e:
        raise QuantizationRefused(f"--int8 with --format torch-export quantizes through torchao's x86 quantizer, "
                                  f"which is not installed here ({e}): {INSTALL}") from None
    return xiq, prepare_pt2e, convert_pt2e


def linear_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s linear layers (what is quantized)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _capture(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch", min=1, max=4096)
    return torch.export.export(model, (x[:2],), dynamic_shapes=({0: batch},)).module()


def convert(model: nn.Module, calibration: np.ndarray, kept: list[str]) -> torch.fx.GraphModule:
    """``model`` (eval, float32, reference attention) with its linear layers but ``kept`` in static int8, calibrated
    on ``calibration`` (N, C, H, W)."""
    xiq, prepare_pt2e, convert_pt2e = _torchao()
    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    quantizer.set_module_type_qconfig(nn.Conv2d, None)  # the patch embedding stays float, as in the ONNX file
    for name in kept:
        quantizer.set_module_name_qconfig(name, None)
    x = torch.from_numpy(calibration)
    graph = prepare_pt2e(_capture(model, x), quantizer)
    with torch.no_grad():
        for chunk in x.split(8):
            graph(chunk)
    return _any_float(convert_pt2e(graph))


def _any_float(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph`` without torch.export's float32 checks on its tensors, so that it also runs under bf16 autocast."""
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten._assert_tensor_metadata.default:
            graph.graph.erase_node(node)
    graph.recompile()
    return graph


def bf16_between() -> bool:
    """Whether the float operations between the int8 products run in bf16 here: on a CPU that multiplies bf16
    natively (AVX512-BF16 or AMX), as OpenVINO does by default; elsewhere bf16 is emulated and they stay float32."""
    return cpu_has_bf16_matmul()


@contextlib.contextmanager
def _frozen(freeze: bool = True):
    """Inductor with the weights frozen into the graph: what lets it fold each dequantize into an int8 kernel.
    ``freeze=False`` leaves them as they are: the int8 program then computes in float after each dequantize, the
    quantized model's numbers without int8 kernels (on a CPU without a safe int8 dot product, ``int8_kernels``)."""
    import torch._inductor.config as inductor

    with inductor.patch(freezing=freeze), torch.no_grad():
        yield


def int8_kernels() -> bool:
    """Whether compiled int8 programs run oneDNN's int8 kernels here: on a CPU with VNNI or AMX. Without them (AVX2
    alone) those kernels can saturate and give other logits than the quantized model; such a CPU gains little from
    int8 anyway, so the program computes in float there (same numbers, no int8 speed-up, which the export reports)."""
    return cpu_has_int8_dot()


def compile_options(autotune: bool) -> dict[str, Any]:
    """Inductor's options for an int8 program: with ``autotune``, max-autotune where this CPU runs int8 kernels (the
    products it times; without them there is nothing int8 to tune)."""
    return dict(AUTOTUNE_OPTIONS if autotune and int8_kernels() else COMPILE_OPTIONS)


def numpy_runner(model: nn.Module, compile: bool = False, bf16: bool = False, freeze: bool = True,
                 autotune: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """``model`` as a function of float32 arrays (what ``quantize.py``'s scoring and timing call), without
    gradients; with ``compile``, compiled by inductor, with frozen weights unless not ``freeze`` (:func:`_frozen`),
    at the sizes it is called with (``autotune``: :func:`compile_options`); with ``bf16``, under bf16 autocast (an
    int8 program: its float operations in bf16)."""
    run = torch.compile(model, dynamic=False, options=compile_options(autotune)) if compile else model

    def call(x: np.ndarray) -> np.ndarray:
        with _frozen(freeze) if compile else torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return run(torch.from_numpy(x)).float().numpy()

    return call


def layer_errors(model: nn.Module, int8: torch.fx.GraphModule, names: list[str],
                 x: np.ndarray) -> list[tuple[str, float]]:
    """Each quantized linear layer's added error, largest first: the relative error of its output in the int8
    program (against the fp32 model's, on ``x``) minus that of its float input."""
    reference: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, inp, out, n=n: reference.__setitem__(n, (inp[0], out))) for n in names]
    xt = torch.from_numpy(x)
    with torch.no_grad():
        model(xt)
    for h in hooks:
        h.remove()
    wanted: dict[torch.fx.Node, tuple[str, int]] = {}
    for node in int8.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        name = list(stack.values())[-1][0] if stack else None
        if node.target is torch.ops.aten.linear.default and name in reference:
            wanted[node] = (name, 1)
            source = node.args[0]
            while getattr(source, "target", None) is not None and "quantized_decomposed" in str(source.target):
                source = source.args[0]  # back through dequantize and quantize to the float input
            wanted[source] = (name, 0)
    got: dict[tuple[str, int], torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if n in wanted:
                got[wanted[n]] = value
            return value

    with torch.no_grad():
        Recorder(int8).run(xt)

    def rel(name: str, k: int) -> float:
        a, b = reference[name][k], got.get((name, k))
        return 0.0 if b is None else float((b - a).norm() / a.norm().clamp_min(1e-12))

    return sorted(((n, rel(n, 1) - rel(n, 0)) for n in reference), key=lambda e: -e[1])


def quantize_program(model: nn.Module, out: str | os.PathLike, calibrate: str | os.PathLike, *,
                     calibration: int = 200, max_drop: float = 0.5, keep: tuple[str, ...] = (),
                     seed: int = 0) -> Int8Report:
    """Write the int8 program of the classifier ``model`` to ``out`` (.pt2), or refuse (see the module docstring)."""
    _torchao()
    m, _ = prepare(model, False)  # the export's own copy: float32, CPU, eval, reference attention, fixed size
    meta = metadata(m, False)
    if meta["vitkit.task"] != "classification" or meta["vitkit.thresholds"] != "null":
        raise QuantizationRefused(f"{model.name} is not a single-label classifier: int8 export scores top-1 on "
                                  "labelled images, which a segmenter or a multi-label model does not have")
    checked = read_metadata(str(out), meta)
    x, y = calibration_set(calibrate, checked.get("labels"), lambda im: preprocess_image(im, checked, str(out)),
                           calibration, seed)
    linear = linear_layers(m)
    kept = [n for n in linear if any(fnmatch.fnmatch(n, p) for p in keep)]
    if keep and not kept:
        raise QuantizationRefused(f"--keep-fp32 {' '.join(keep)} matches no linear layer; their names look like "
                                  f"{', '.join(linear[:3])} (patterns as fnmatch's: 'blocks.11.*', '*.fc2')")
    int8 = convert(m, x[:calibration], kept)
    held_x, held_y, bf16 = x[calibration:], y[calibration:], bf16_between()
    report = Int8Report(str(out), "static", calibration, len(held_y), top1(numpy_runner(m), held_x, held_y),
                        top1(numpy_runner(int8, bf16=bf16), held_x, held_y), len(linear) - len(kept), kept,
                        runtime="torch.compile" + (", bf16 between the int8 products" if bf16 else ""))
    if report.drop > max_drop:
        raise refusal(report, max_drop, layer_errors(m, int8, [n for n in linear if n not in kept], held_x[:16]))
    report.fp32_ms, report.int8_ms = batch1_ms([numpy_runner(copy.deepcopy(m), True),
                                                numpy_runner(int8, True, bf16, int8_kernels())], held_x)
    meta["vitkit.int8"] = json.dumps({"mode": "static", "quantizer": "torchao X86InductorQuantizer",
                                      "calibrated": calibration, "held_out": report.held_out,
                                      "fp32_top1": report.fp32_score, "int8_top1": report.int8_score, "kept": kept,
                                      "scored_with": "bf16" if bf16 else "float32"})
    _save(int8, held_x, Path(out), meta)
    return report


def _save(int8: torch.fx.GraphModule, x: np.ndarray, path: Path, meta: dict[str, str]) -> None:
    """The int8 program with its metadata, written atomically once it loads back and gives the same outputs."""
    xt = torch.from_numpy(x[:3])
    program = torch.export.export(int8, (xt[:2],), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.pt2")  # torch.export.save wants the .pt2 ending
    try:
        torch.export.save(program, str(tmp), extra_files={PROGRAM_METADATA: json.dumps(meta)})
        with torch.no_grad():
            diff = float((torch.export.load(str(tmp)).module()(xt) - int8(xt)).abs().max())
        if diff > 1e-4:
            raise QuantizationRefused(f"the int8 program written to {path} gives outputs {diff:.2e} away from the "
                                      "quantized model's when loaded back; nothing was written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Int8Program(nn.Module):
    """An int8 .pt2 of ``vitkit export --format torch-export --int8``, compiled on its first call (inductor, weights
    frozen; a new batch size compiles again), with the file's ``vitkit.*`` metadata as ``meta``. ``bf16``: the float
    operations between the int8 products in bf16 (None: where this CPU has native bf16, :func:`bf16_between`); the
    logits are float32 either way. ``autotune``: compiled with max-autotune (the module docstring), each batch size
    on its own."""

    def __init__(self, path: str | os.PathLike, bf16: bool | None = None, autotune: bool = False) -> None:
        super().__init__()
        _torchao()  # registers the quantize/dequantize operators the program holds
        files = {PROGRAM_METADATA: ""}
        try:  # torch.export's own errors for a missing, damaged or foreign file
            self.program = torch.export.load(str(path), extra_files=files).module()
            meta = json.loads(files[PROGRAM_METADATA] or "{}")
        except Exception as e:  # noqa: BLE001
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path} is not a program torch.export can load with vitkit's metadata: {text}") \
                from None
        if not isinstance(meta, dict) or "vitkit.int8" not in meta:
            raise CheckpointError(f"{path} is not an int8 program of `vitkit export --format torch-export --int8` "
                                  "(no vitkit.int8 in its vitkit.json)")
        self.meta: dict[str, Any] = read_metadata(str(path), meta)
        self.bf16 = bf16_between() if bf16 is None else bf16
        self.int8_kernels = int8_kernels()
        self.program = _any_float(self.program)
        self.options = compile_options(autotune)
        # autotuned: one program per batch size (inductor's C++ GEMMs are tuned and written for fixed sizes; its
        # dynamic-shape recompile of an autotuned program fails in a bmm)
        self.compiled = torch.compile(self.program, dynamic=False if autotune else None, options=self.options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _frozen(self.int8_kernels), torch.autocast("cpu", torch.bfloat16, enabled=self.bf16):
            return self.compiled(x).float()


def load_int8_program(path: str | os.PathLike, bf16: bool | None = None, autotune: bool = False) -> Int8Program:
    """The int8 program at ``path``, ready to run fast on the CPU (see :class:`Int8Program`)."""
    return Int8Program(path, bf16, autotune)
