"""Peak memory and step time of fine-tuning a large backbone four ways: the whole model, LoRA (rank 8 by default,
``--lora-rank``, on the attention's qkv and proj, the head trained too), LoRA with gradient checkpointing, and a
frozen backbone (the head alone).

Each (model, way) runs in a fresh process: build the model (random weights, 10 classes), AdamW over what trains,
``--warmup`` steps and then ``--steps`` timed steps on random images at 224 px (``--img-size``), fp32; the
process's peak resident memory (``ru_maxrss``) is its figure on a CPU, and ``torch.cuda.max_memory_allocated`` on
a GPU (``benchmarks/gpu_check.sh`` runs it there).

    python benchmarks/finetune_memory.py --models vit_base_patch16_224,vit_large_patch16_224 --batch-size 32 \
        --out benchmarks/results/finetune_memory_xeon.md
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

WAYS = ("full", "lora", "lora+checkpointing", "frozen")


def probe(model: str, way: str, batch: int, warmup: int, steps: int, device: str, img_size: int = 224,
          rank: int = 8) -> dict:
    """One (model, way) in this process: peak memory (MiB) and the median step time (s)."""
    import vitkit
    from vitkit.models.lora import LoraSettings, add_lora

    net = vitkit.create_model(model, num_classes=10, img_size=img_size).to(device).train()
    if way.startswith("lora"):
        add_lora(net, LoraSettings(rank=rank))
        net.set_grad_checkpointing(way == "lora+checkpointing")
    if way in ("lora", "lora+checkpointing", "frozen"):
        for name, p in net.named_parameters():
            p.requires_grad_(p.requires_grad and way != "frozen" or name.startswith("head"))
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    x, y = torch.randn(batch, 3, img_size, img_size, device=device), torch.randint(0, 10, (batch,), device=device)
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_mib": peak, "step_s": statistics.median(times), "trained": sum(p.numel() for p in trained),
            "params": sum(p.numel() for p in net.parameters())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=["vit_base_patch16_224", "vit_large_patch16_224"])
    p.add_argument("--ways", type=lambda s: s.split(","), default=list(WAYS))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("bench/finetune_memory.md"))
    p.add_argument("--_probe", nargs=2, metavar=("MODEL", "WAY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._probe:
        print(json.dumps(probe(*args._probe, args.batch_size, args.warmup, args.steps, args.device, args.img_size,
                               args.lora_rank)))
        return
    unit = "peak GPU memory allocated" if args.device == "cuda" else "peak RSS"
    rows = [f"| model | way | trained parameters | {unit} (MiB) | step (s) |", "|---|---|---|---|---|"]
    for model in args.models:
        for way in args.ways:
            cmd = [sys.executable, __file__, "--_probe", model, way, "--batch-size", str(args.batch_size),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--device", args.device,
                   "--img-size", str(args.img_size), "--lora-rank", str(args.lora_rank)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                rows.append(f"| {model} | {way} | | failed: {done.stderr.strip().splitlines()[-1][:80]} | |")
            else:
                r = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(f"| {model} | {way} | {r['trained'] / 1e6:.2f} M of {r['params'] / 1e6:.2f} M | "
                            f"{r['peak_mib']:.0f} | {r['step_s']:.2f} |")
            print(rows[-1], flush=True)
    where = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    text = "\n".join(rows) + (f"\n\nbatch {args.batch_size}, {args.img_size} px, fp32, AdamW, LoRA rank "
                              f"{args.lora_rank} on attn.qkv and "
                              f"attn.proj; {args.warmup} warm-up and {args.steps} timed steps; {where}, torch "
                              f"{torch.__version__}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
