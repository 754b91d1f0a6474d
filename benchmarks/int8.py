"""int8 against fp32 on the CPU: vitkit's ONNX export in onnxruntime (fp32 as ``vitkit export`` writes it, static and
dynamic int8 as ``vitkit export --int8`` does), the same static int8 graph in OpenVINO (where ``pip install
openvino`` put it beside vitkit; its float work in its default precision, bf16 where the CPU has it, and in f32),
and vitkit's PyTorch model in bf16, and with ``--pt2e`` the int8 .pt2 compiled (its float work in bf16 where the CPU
has native bf16, as ``load_int8_program`` runs it, and in float32; with ``--autotune`` also as
``load_int8_program(path, autotune=True)`` runs it), at batch 1 and 8. Random weights (the speed does
not depend on them); the static model is calibrated on 32 random inputs. Every entry is timed in interleaved rounds
after a warm-up; the median ms per batch is reported. Each timed block starts after a pause (``--pause``):
onnxruntime's and OpenVINO's worker threads spin for a while after a call, and on a few cores they would take time
from the entry timed next.

    python benchmarks/int8.py --models vit_base_patch16_224,deit_small_patch16_224,swin_tiny_patch4_window7_224 \\
        --out benchmarks/results/int8_cpu.md
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import vitkit
from vitkit.benchmarking.bench import cpu_name, interleaved_ms, onnx_runner, publish
from vitkit.deploy.export import INPUT, OPSET, export_onnx, prepare
from vitkit.deploy.quantize import CalibrationBatches, int8_fixed_size, linear_nodes, write_int8
from vitkit.models.config import pair


def _openvino(path: Path, threads: int, precision: str | None = None) -> Callable[[np.ndarray], None] | None:
    try:
        import openvino as ov
    except ImportError:
        return None
    config = {"INFERENCE_NUM_THREADS": threads, **({"INFERENCE_PRECISION_HINT": precision} if precision else {})}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    return lambda x: compiled(x)


def _bf16(model: torch.nn.Module) -> Callable[[np.ndarray], None]:
    m = model.to(torch.bfloat16)

    def run(x: np.ndarray) -> None:
        with torch.no_grad():
            m(torch.from_numpy(x).to(torch.bfloat16))

    return run


def _entries(model: torch.nn.Module, tmp: Path, threads: int, pt2e: bool, opset: int,
             autotune: bool) -> dict[str, Callable]:
    """Each entry's run function: the exports as the CLI writes them (``--opset`` for the int8 graph; a Swin's int8
    at its own size)."""
    import onnx

    h, w = pair(model.cfg.img_size)
    fp32, graph = tmp / f"{model.name}.onnx", tmp / f"{model.name}.int8-graph.onnx"
    export_onnx(model, fp32)
    export_onnx(model, graph, opset=opset, dynamic_size=False if int8_fixed_size(model) else None)
    nodes = linear_nodes(onnx.load(str(graph)))
    calibration = np.random.default_rng(0).standard_normal((32, 3, h, w)).astype(np.float32)
    static, dynamic = tmp / f"{model.name}.static.onnx", tmp / f"{model.name}.dynamic.onnx"
    write_int8(str(graph), static, "static", CalibrationBatches(INPUT, calibration), nodes, "minmax")
    write_int8(str(graph), dynamic, "dynamic", None, nodes, "minmax")
    entries = {"fp32": onnx_runner(fp32, threads), "static": onnx_runner(static, threads),
               "dynamic": onnx_runner(dynamic, threads),
               "openvino": _openvino(static, threads), "openvino_f32": _openvino(static, threads, "f32"),
               **(_pt2e(model, calibration, autotune) if pt2e else {}),
               "pt_fp32": _compiled_fp32(model) if pt2e else None, "bf16": _bf16(copy.deepcopy(model))}
    return {k: v for k, v in entries.items() if v is not None}


def _pt2e(model: torch.nn.Module, calibration: np.ndarray, autotune: bool) -> dict[str, Callable[[np.ndarray], None]]:
    """PyTorch's own x86 int8 as ``vitkit export --format torch-export --int8`` writes it (torchao's
    X86InductorQuantizer, static, calibrated on the same inputs), compiled by inductor with frozen weights: as
    ``load_int8_program`` runs it (``pt2e``: bf16 between the int8 products where the CPU has native bf16), with
    float32 between them (``pt2e_f32``, where that differs), and with ``autotune`` as ``load_int8_program(path,
    autotune=True)`` runs it (``pt2e_autotune``)."""
    from vitkit.deploy.quantize import QuantizationRefused
    from vitkit.deploy.quantize_program import bf16_between, convert, int8_kernels, numpy_runner

    try:
        graph = convert(prepare(model, False)[0], calibration, [])
    except QuantizationRefused:  # torchao is not installed
        return {}
    bf16 = bf16_between()
    return {"pt2e_f32": numpy_runner(copy.deepcopy(graph), True, False, int8_kernels()) if bf16 else None,
            "pt2e_autotune": numpy_runner(copy.deepcopy(graph), True, bf16, int8_kernels(), autotune=True) if autotune
            else None,
            "pt2e": numpy_runner(graph, True, bf16, int8_kernels())}


def _compiled_fp32(model: torch.nn.Module) -> Callable[[np.ndarray], None]:
    """The fp32 model the int8 program is quantized from (the export's copy), compiled the same way: what the int8
    program's speed-up is measured against in its own runtime."""
    from vitkit.deploy.quantize_program import numpy_runner

    return numpy_runner(prepare(model, False)[0], compile=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit_base_patch16_224,deit_small_patch16_224,swin_tiny_patch4_window7_224")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--opset", type=int, default=OPSET, help="the int8 graph's ONNX opset (vitkit export --opset)")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds idle before each timed block")
    ap.add_argument("--pt2e", action="store_true", help="also PyTorch's x86 int8 as `vitkit export --format "
                    "torch-export --int8` writes it, and the fp32 model, both torch.compile'd (needs torchao)")
    ap.add_argument("--autotune", action="store_true", help="with --pt2e, also the int8 .pt2 compiled with "
                    "max-autotune, as load_int8_program(path, autotune=True) runs it (minutes of compile per size)")
    ap.add_argument("--out", type=Path, default=None, help="a markdown table (printed too)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_name()
    rows = [f"CPU: {cpu}, {args.threads} threads; torch {torch.__version__}; median ms per batch of "
            f"{args.rounds} interleaved rounds x {args.iters} calls, "
            f"{args.pause} s idle before each; the int8 graphs at opset {args.opset}", "",
            "| model | batch | fp32 (onnxruntime) | int8 static | int8 dynamic | int8 static (OpenVINO) "
            "| int8 static (OpenVINO, f32 between) | bf16 (PyTorch) |"
            + (" fp32 (PyTorch, compiled) | int8 (PyTorch x86, compiled, f32 between) | int8 (PyTorch x86, compiled, "
               "as loaded): x over compiled fp32 |" if args.pt2e else "")
            + (" int8 (PyTorch x86, compiled with max-autotune): x over compiled fp32 |"
               if args.pt2e and args.autotune else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.pt2e else "")
            + ("---|" if args.pt2e and args.autotune else "")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            torch.manual_seed(0)
            model = vitkit.create_model(name).eval()
            h, w = pair(model.cfg.img_size)
            entries = _entries(model, Path(tmp), args.threads, args.pt2e, args.opset, args.autotune)
            for batch in map(int, args.batch_sizes.split(",")):
                x = np.random.default_rng(1).standard_normal((batch, 3, h, w)).astype(np.float32)
                ms = interleaved_ms(entries, x, args.rounds, args.iters, args.pause)

                def cell(k: str, ms=ms) -> str:
                    return f"{ms[k]:.1f} ({ms['fp32'] / ms[k]:.2f}x)" if k in ms else "-"

                rows.append(f"| {name} | {batch} | {ms['fp32']:.1f} | {cell('static')} | {cell('dynamic')} | "
                            f"{cell('openvino')} | {cell('openvino_f32')} | {cell('bf16')} |"
                            + (f" {cell('pt_fp32')} | {ms.get('pt2e_f32', ms['pt2e']):.1f} | "
                               f"{ms['pt2e']:.1f} ({ms['pt_fp32'] / ms['pt2e']:.2f}x) |" if "pt2e" in ms else "")
                            + (f" {ms['pt2e_autotune']:.1f} ({ms['pt_fp32'] / ms['pt2e_autotune']:.2f}x) |"
                               if "pt2e_autotune" in ms else ""))
                print(rows[-1], flush=True)
    publish("\n".join(rows), args.out)


if __name__ == "__main__":
    main()
