"""RF-DETR's batch-1 latency on the CPU: transformers' ``RfDetrForObjectDetection`` in PyTorch beside the same model
(its ``save_pretrained`` folder loaded by ``vitkit.load_detector``) in vitkit's PyTorch, vitkit's ONNX export in
onnxruntime (fp32 as ``vitkit export`` writes it) and its static int8 (the linear layers, as ``vitkit export --int8``
quantizes them; calibrated on 16 random inputs: the speed does not depend on the weights). RF-DETR Base's shape
(transformers' ``RfDetrConfig`` defaults: DINOv2 ViT-S/14 in 4 x 4 windows, 300 queries, 3 decoder layers) with
random weights, its positions at the size timed, at 560 px (RF-DETR Base's size) and a smaller one. Every entry is
timed in interleaved rounds after a warm-up; the median ms is reported, with each entry's speed-up over
transformers.

    python benchmarks/detection.py --out benchmarks/results/detection_cpu.md
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import vitkit
from vitkit.benchmarking.bench import cpu_name, interleaved_ms, onnx_runner, publish
from vitkit.deploy.export import INPUT, export_onnx
from vitkit.deploy.quantize import CalibrationBatches, linear_nodes, write_int8
from vitkit.tasks.detection.inference import ExportedDetector


def _torch(model: torch.nn.Module, transformers_model: bool = False) -> Callable[[np.ndarray], None]:
    def run(x: np.ndarray) -> None:
        with torch.inference_mode():
            if transformers_model:
                model(pixel_values=torch.from_numpy(x))
            else:
                model(torch.from_numpy(x))

    return run


def _entries(folder: Path, tmp: Path, size: int, threads: int) -> dict[str, Callable]:
    import onnx
    from transformers import RfDetrForObjectDetection

    theirs = RfDetrForObjectDetection.from_pretrained(folder).eval()
    ours = vitkit.load_detector(folder).eval()
    exported = ExportedDetector(ours, "rf_detr_base", ours.class_names)
    fp32, int8 = tmp / f"rf_{size}.onnx", tmp / f"rf_{size}.int8.onnx"
    export_onnx(exported, fp32)
    calibration = np.random.default_rng(0).standard_normal((16, 3, size, size)).astype(np.float32)
    write_int8(str(fp32), int8, "static", CalibrationBatches(INPUT, calibration), linear_nodes(onnx.load(str(fp32))),
               "minmax")
    return {"transformers": _torch(theirs, transformers_model=True), "vitkit": _torch(ours),
            "onnx_fp32": onnx_runner(fp32, threads), "onnx_int8": onnx_runner(int8, threads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="560,336", help="input sides, multiples of 56 (the patch x the windows)")
    ap.add_argument("--classes", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--pause", type=float, default=0.3, help="seconds idle before each timed block")
    ap.add_argument("--out", type=Path, default=None, help="a markdown table (printed too)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import RfDetrConfig, RfDetrForObjectDetection

    cpu = cpu_name()
    import transformers

    rows = [f"CPU: {cpu}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"RF-DETR Base's shape, {args.classes} classes, batch 1; median ms of {args.rounds} interleaved rounds x "
            f"{args.iters} calls, {args.pause} s idle before each", "",
            "| size | transformers (PyTorch) | vitkit (PyTorch) | vitkit ONNX fp32 (onnxruntime) | "
            "vitkit ONNX int8 static (onnxruntime) | int8 over fp32 ONNX |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for size in map(int, args.sizes.split(",")):
            torch.manual_seed(0)
            folder = Path(tmp) / f"rf_detr_base_{size}"
            backbone = {"model_type": "rf_detr_dinov2", "hidden_size": 384, "num_attention_heads": 6,
                        "out_features": ["stage2", "stage5", "stage8", "stage11"], "image_size": size}
            RfDetrForObjectDetection(RfDetrConfig(num_labels=args.classes, backbone_config=backbone)).save_pretrained(
                folder)  # positions at the size timed: neither model resamples them
            entries = _entries(folder, Path(tmp), size, args.threads)
            x = np.random.default_rng(1).standard_normal((1, 3, size, size)).astype(np.float32)
            ms = interleaved_ms(entries, x, args.rounds, args.iters, args.pause)

            def cell(k: str, ms=ms) -> str:
                return f"{ms[k]:.0f} ({ms['transformers'] / ms[k]:.2f}x)"

            rows.append(f"| {size} | {ms['transformers']:.0f} | {cell('vitkit')} | {cell('onnx_fp32')} | "
                        f"{cell('onnx_int8')} | {ms['onnx_fp32'] / ms['onnx_int8']:.2f}x |")
            print(rows[-1], flush=True)
    publish("\n".join(rows), args.out)


if __name__ == "__main__":
    main()
