"""What each segmentation head costs on its backbone: parameters, GMACs per image (the head's share beside the
backbone's) and inference seconds per image, at the sizes the heads are used at (DINOv2's 518 px, mmsegmentation's
512 px for Swin). The entries run in interleaved rounds in one process, so load and clock drift hit all of them.

    python benchmarks/segmentation_heads.py --rounds 3 --iters 2 --out benchmarks/results/segmentation_heads_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import vitkit
from vitkit.benchmarking.bench import device_name
from vitkit.benchmarking.flops import count_gmacs_of
from vitkit.models.segmentation import build_segmenter

# (backbone, its input size, head, indices, the head's arguments): the heads as their recipes build them
ENTRIES = [
    ("vit_small_patch14_dinov2", 518, "linear", None, {}),
    ("vit_small_patch14_dinov2", 518, "linear", [8, 9, 10, 11], {}),
    ("vit_small_patch14_dinov2", 518, "dpt", None, {"channels": 256}),
    ("vit_small_patch14_dinov2", 518, "upernet", None, {"channels": 512}),
    ("swin_tiny_patch4_window7_224", 512, "upernet", None, {"channels": 512}),
]


def build(name: str, size: int, head: str, indices, head_args: dict, classes: int):
    backbone = vitkit.create_model(name, num_classes=0, img_size=size)
    return build_segmenter(backbone, head, classes, indices, auxiliary=False, **head_args)


def label(name: str, head: str, indices) -> str:
    return f"{name} + {head}" + (f" (layers {indices[0]}-{indices[-1]})" if indices else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=150, help="ADE20k's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2, help="timed images per entry per round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/segmentation_heads_cpu.md"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, models = [], []
    for name, size, head, indices, head_args in ENTRIES:
        model = build(name, size, head, indices, head_args, args.classes).eval()
        spec = (name, size, head, indices, head_args, args.classes)
        total = count_gmacs_of(lambda spec=spec: build(*spec), (3, size, size))
        body = count_gmacs_of(lambda n=name, s=size: vitkit.create_model(n, num_classes=0, img_size=s), (3, size, size))
        heads = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("backbone."))
        rows.append({"entry": label(name, head, indices), "size": size, "backbone_m": sum(
            p.numel() for p in model.backbone.parameters()) / 1e6, "head_m": heads / 1e6, "gmacs": total,
            "head_gmacs": total - body, "times": []})
        models.append((model, torch.randn(1, 3, size, size)))
        with torch.no_grad():
            model(models[-1][1])  # warm-up
    for r in range(args.rounds):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            model, x = models[i]
            with torch.no_grad():
                for _ in range(args.iters):
                    start = time.perf_counter()
                    model(x)
                    rows[i]["times"].append(time.perf_counter() - start)
    cpu = device_name(torch.device("cpu"))
    lines = [f"Segmentation heads, inference at batch 1, fp32, {args.classes} classes; {cpu}, "
             f"torch {torch.__version__}; median of {args.rounds} interleaved rounds x {args.iters} images.", "",
             "| model | px | backbone M params | head M params | GMACs | of which the head | s / image |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['entry']} | {row['size']} | {row['backbone_m']:.1f} | {row['head_m']:.2f} | "
                     f"{row['gmacs']:.1f} | {row['head_gmacs']:.1f} | {statistics.median(row['times']):.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
