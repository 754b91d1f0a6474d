"""Which attention path wins on this machine: PyTorch's SDPA kernel or vitkit's explicit path, for the shapes of
ViT-B/16, ViT-S/16 and Swin-T, in float32 and bf16, for inference and for a training step (forward + backward);
and whether ``attn_backend="auto"`` (which times both paths at the first call of each kind, ``layers/autotune.py``)
picks the winner here. Run it on any CPU (or GPU):

    python benchmarks/attention_paths.py                  # prints a table; --out FILE.md writes it too

q, k and v are the strided views of a fused projection, as the models pass them; Swin's cases add its
relative-position bias and a shifted block's window mask, the bias learned (with its gradient) in training.
Each case times both paths in alternating rounds (median of ``--rounds`` x ``--iters`` calls); a path within
``--tie`` of the other counts as a tie, where either choice is right.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vitkit.layers import autotune
from vitkit.layers.attention import attention
from vitkit.layers.kernels import cpu_has_amx, cpu_has_bf16_matmul


@dataclass
class Case:
    name: str
    B: int  # images (x windows for Swin)
    H: int
    N: int
    D: int
    windows: int = 1  # Swin: windows per image, each with its own mask row


CASES = [
    Case("ViT-B/16 b8", 8, 12, 197, 64),
    Case("ViT-S/16 b8", 8, 6, 197, 64),
    Case("Swin-T stage 1 b8", 8, 3, 49, 32, windows=64),
    Case("Swin-T stage 3 b8", 8, 12, 49, 32, windows=4),
]


def inputs(c: Case, dtype: torch.dtype, train: bool, device: torch.device):
    """q, k, v as views of a (B·G, N, 3·H·D) projection; Swin's bias and shift mask."""
    g = torch.Generator(device="cpu").manual_seed(0)
    BG = c.B * c.windows
    qkv = torch.randn(BG, c.N, 3 * c.H * c.D, generator=g).to(device, dtype).requires_grad_(train)
    q, k, v = (t.unflatten(-1, (c.H, c.D)).transpose(1, 2) for t in qkv.split(c.H * c.D, dim=-1))
    bias = mask = None
    if c.windows > 1:
        bias = torch.randn(1, 1, c.H, c.N, c.N, generator=g).to(device, dtype).requires_grad_(train)
        mask = (torch.rand(1, c.windows, 1, c.N, c.N, generator=g) > 0.2).to(device)
        mask[..., 0] = True
    lead = [c.B, c.windows] if c.windows > 1 else [c.B]
    return qkv, (q, k, v), lead, bias, mask


def timer(c: Case, backend: str, dtype: torch.dtype, train: bool, device: torch.device):
    qkv, (q, k, v), lead, bias, mask = inputs(c, dtype, train, device)
    scale = c.D**-0.5

    def step() -> None:
        with torch.set_grad_enabled(train):
            o, _ = attention(q, k, v, lead, bias, mask, None, False, backend, scale, 0.0, False)
            if train:
                o.sum().backward(inputs=[qkv] + ([bias] if bias is not None else []))
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def measure(c: Case, dtype: torch.dtype, train: bool, rounds: int, iters: int, device: torch.device) -> dict:
    steps = {b: timer(c, b, dtype, train, device) for b in ("sdpa", "math")}
    for s in steps.values():
        s()  # warm-up
    times: dict[str, list[float]] = {b: [] for b in steps}
    for r in range(rounds):
        for b in (("sdpa", "math") if r % 2 == 0 else ("math", "sdpa")):  # alternate who goes first
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[b]()
            times[b].append((time.perf_counter() - t0) / iters)
    med = {b: statistics.median(t) for b, t in times.items()}
    autotune.reset()
    timer(c, "auto", dtype, train, device)()  # the first call of its kind: auto times both paths and keeps one
    picked = set(autotune.choices().values()) or {"sdpa"}  # off the CPU nothing is timed: the kernel
    return med | {"auto": picked.pop()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tie", type=float, default=0.05, help="relative gap under which both paths count as right")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    head = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul "
            f"{cpu_has_bf16_matmul()}, AMX {cpu_has_amx()}, device {device}")
    rows = [head, "", "| case | dtype | mode | sdpa ms | math ms | winner | auto picks | right |",
            "|---|---|---|---|---|---|---|---|"]
    wrong = 0
    print(head)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for train in (False, True):
            for c in CASES:
                m = measure(c, dtype, train, args.rounds, args.iters, device)
                fast, slow = sorted(("sdpa", "math"), key=m.get)
                tie = m[slow] <= m[fast] * (1 + args.tie)
                right = tie or m["auto"] == fast
                wrong += not right
                row = (f"| {c.name} | {str(dtype).removeprefix('torch.')} | {'train' if train else 'infer'} | "
                       f"{m['sdpa'] * 1e3:.2f} | {m['math'] * 1e3:.2f} | {'tie' if tie else fast} | {m['auto']} | "
                       f"{'yes' if right else 'NO'} |")
                rows.append(row)
                print(row, flush=True)
    summary = f"auto picks the winner (or one of a tie) in {len(rows) - 4 - wrong} of {len(rows) - 4} cases"
    print(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(rows + ["", summary]) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
