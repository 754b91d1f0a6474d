"""Training memory with and without ``set_grad_checkpointing()``, vitkit beside timm.

Two figures per model, library and setting:
- the activations a forward pass keeps for backward (bytes of the distinct tensors autograd saves,
  counted with saved-tensor hooks; exact and the same on every run);
- the peak resident memory of a fresh process that builds the model and runs two AdamW training steps
  (``vitkit bench``'s probe), the median of ``--repeats`` processes (glibc's allocator makes one run noisy).

    python benchmarks/grad_checkpointing.py --models vit_small_patch16_224,swin_tiny_patch4_window7_224 \
        --batch-size 16 --out benchmarks/results/grad_checkpointing.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import timm
import torch

import vitkit
from vitkit.benchmarking.flops import saved_activations_mib


def peak_rss_mib(library: str, model: str, batch: int, grad_ckpt: bool) -> float:
    cmd = [sys.executable, "-m", "vitkit.cli", "bench", "--_mem-probe", library, "--models", model, "--mode", "train",
           "--batch-sizes", str(batch), "--peers", library] + (["--grad-checkpointing"] if grad_ckpt else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=["vit_small_patch16_224"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/grad_checkpointing.md"))
    args = p.parse_args(argv)
    rows = ["| model | library | grad checkpointing | saved activations (MiB) | peak RSS, median (MiB) | runs |",
            "|---|---|---|---|---|---|"]
    for name in args.models:
        x = torch.randn(args.batch_size, 3, 224, 224)
        for library, build in (("vitkit", vitkit.create_model), ("timm", timm.create_model)):
            net = build(name).train()
            for gc in (False, True):
                net.set_grad_checkpointing(gc)
                act = saved_activations_mib(net, x)
                runs = [peak_rss_mib(library, name, args.batch_size, gc) for _ in range(args.repeats)]
                rows.append(f"| {name} | {library} | {'on' if gc else 'off'} | {act:.0f} | "
                            f"{statistics.median(runs):.0f} | {', '.join(f'{r:.0f}' for r in runs)} |")
                print(rows[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    text = "\n".join(rows) + f"\n\nbatch {args.batch_size}, 224 px, fp32, AdamW; {cpu}, torch {torch.__version__}\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
