"""What DINO costs a training step: a DINO step (multi-crop on the device, the teacher's forward on the global
crops, the student's on every crop, DINO + iBOT + KoLeo, AdamW, the teacher's moving average) beside a classifier
step on the same images (one view, cross-entropy, AdamW), for each backbone. Each (backbone, step) runs in its own
process, so that its peak memory is its own; the rounds alternate the order, so load and clock drift hit both.

    python benchmarks/dino_cost.py --models vit_small_patch14_dinov2,vit_base_patch14_dinov2 --img-size 224 \
        --batch-size 8 --out benchmarks/results/dino_cost_cpu.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from vitkit.benchmarking.bench import device_name


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set (Linux: KiB)


def measure(model: str, kind: str, img_size: int, batch: int, iters: int, device: str, local_crops: int) -> dict:
    """Seconds per step (median of ``iters`` after one warm-up step) and the peak memory, in this process."""
    from vitkit.lit import DINOPretraining, ImageClassifier

    dev = torch.device(device)
    torch.manual_seed(0)
    if kind == "dino":  # DINOv2's heads: 65,536 prototypes, 2 global crops and `local_crops` local ones
        module = DINOPretraining(model, img_size=img_size, local_crops=local_crops, koleo_weight=0.1)
    else:
        module = ImageClassifier(model, num_classes=1000, img_size=img_size)
    module = module.to(dev).train()
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    images = torch.rand(batch, 3, img_size, img_size, device=dev)
    labels = torch.randint(0, 1000, (batch,), device=dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if kind == "dino":
            glob, local, mask = module._crops(images)
            loss = module.model(glob, local, mask, teacher_temp=0.07).loss
        else:
            loss = module._loss(images, labels)
        loss.backward()
        opt.step()
        if kind == "dino":
            module.model.update_teacher(0.996)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - start)
    return {"s": statistics.median(times), "peak": _peak_bytes(dev)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit_small_patch14_dinov2,vit_base_patch14_dinov2")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--local-crops", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # model,kind: measure in this process
    args = p.parse_args()
    if args.one:
        model, kind = args.one.split(",")
        print(json.dumps(measure(model, kind, args.img_size, args.batch_size, args.iters, args.device,
                                 args.local_crops)))
        return
    models = args.models.split(",")
    runs: dict[tuple[str, str], list[dict]] = {(m, k): [] for m in models for k in ("classifier", "dino")}
    for r in range(args.rounds):
        for key in list(runs)[:: 1 if r % 2 == 0 else -1]:
            cmd = [sys.executable, __file__, "--one", ",".join(key), "--img-size", str(args.img_size),
                   "--batch-size", str(args.batch_size), "--iters", str(args.iters), "--device", args.device,
                   "--local-crops", str(args.local_crops)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[key].append(json.loads(out.strip().splitlines()[-1]))
            print(key, runs[key][-1], flush=True)
    gib = 2 ** 30
    memory = "peak CUDA memory allocated" if args.device.startswith("cuda") else "peak resident memory of the process"
    lines = [f"# DINO step cost beside a classifier step ({args.img_size} px, batch {args.batch_size})", "",
             f"{device_name(torch.device(args.device))}, fp32, torch {torch.__version__}; DINO: 2 global crops at "
             f"{args.img_size} px and "
             f"{args.local_crops} local ones, 65,536 prototypes, iBOT and KoLeo; median of {args.rounds} processes "
             f"x {args.iters} steps; memory: {memory}", "",
             "| backbone | step | s / step | img/s | memory (GiB) | DINO / classifier time |",
             "|---|---|---|---|---|---|"]
    for m in models:
        cls, dino = (statistics.median(x["s"] for x in runs[(m, k)]) for k in ("classifier", "dino"))
        for k, s in (("classifier", cls), ("dino", dino)):
            peak = max(x["peak"] for x in runs[(m, k)]) / gib
            ratio = f"{dino / cls:.2f}x" if k == "dino" else ""
            lines.append(f"| {m} | {k} | {s:.3f} | {args.batch_size / s:.2f} | {peak:.2f} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
