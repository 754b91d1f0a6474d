"""Depth Anything's batch-1 latency on the CPU: transformers' ``DepthAnythingForDepthEstimation`` in PyTorch beside the
same model (its ``save_pretrained`` folder loaded by ``vitkit.load_depth_estimator``) in vitkit's PyTorch, vitkit's
ONNX export in onnxruntime (fp32 as ``vitkit export`` writes it) and its static int8 (the linear layers, the
convolutions and the attention's products, as ``vitkit export --int8`` quantizes a depth model; calibrated on 4
random inputs: the speed does not depend on the weights).
Depth Anything V2 Small's shape (DINOv2 ViT-S/14 read at blocks 3, 6, 9 and 12, DPT's neck of 48 to 384 channels
fused at 64) with random weights, at 518 px (its size) and a smaller one. Every entry is timed in interleaved rounds
after a warm-up; the median ms is reported, with each entry's speed-up over transformers.

    python benchmarks/depth.py --out benchmarks/results/depth_cpu.md
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
from vitkit.tasks.depth.quantize import AbsRel

SMALL = {"backbone_config": {"model_type": "dinov2", "hidden_size": 384, "num_attention_heads": 6,
                             "out_indices": [3, 6, 9, 12], "image_size": 518, "patch_size": 14,
                             "reshape_hidden_states": False},
         "neck_hidden_sizes": [48, 96, 192, 384], "fusion_hidden_size": 64, "head_hidden_size": 32,
         "reassemble_hidden_size": 384, "depth_estimation_type": "relative"}


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
    from transformers import DepthAnythingForDepthEstimation

    theirs = DepthAnythingForDepthEstimation.from_pretrained(folder).eval()
    ours = vitkit.load_depth_estimator(folder).eval()
    fp32, int8 = tmp / f"depth_{size}.onnx", tmp / f"depth_{size}.int8.onnx"
    export_onnx(ours, fp32)
    calibration = np.random.default_rng(0).standard_normal((4, 3, size, size)).astype(np.float32)  # 16 at 518: 24 GiB
    nodes = linear_nodes(onnx.load(str(fp32)), AbsRel.layers)
    write_int8(str(fp32), int8, "static", CalibrationBatches(INPUT, calibration), nodes, "minmax")
    return {"transformers": _torch(theirs, transformers_model=True), "vitkit": _torch(ours),
            "onnx_fp32": onnx_runner(fp32, threads), "onnx_int8": onnx_runner(int8, threads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="518,252", help="input sides, multiples of 14 (the patch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--pause", type=float, default=0.3, help="seconds idle before each timed block")
    ap.add_argument("--out", type=Path, default=None, help="a markdown table (printed too)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation

    cpu = cpu_name()
    rows = [f"CPU: {cpu}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"Depth Anything V2 Small's shape, batch 1; median ms of {args.rounds} interleaved rounds x {args.iters} "
            f"calls, {args.pause} s idle before each", "",
            "| size | transformers (PyTorch) | vitkit (PyTorch) | vitkit ONNX fp32 (onnxruntime) | "
            "vitkit ONNX int8 static (onnxruntime) | int8 over fp32 ONNX |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for size in map(int, args.sizes.split(",")):
            torch.manual_seed(0)
            folder = Path(tmp) / f"depth_anything_small_{size}"
            config = {**SMALL, "backbone_config": {**SMALL["backbone_config"], "image_size": size}}
            DepthAnythingForDepthEstimation(DepthAnythingConfig(**config)).save_pretrained(folder)  # positions at
            entries = _entries(folder, Path(tmp), size, args.threads)  # the size timed: neither resamples them
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
