"""Which model sizes and image sizes are practical on a CPU: inference and training images per second of vitkit's
presets at a few image sizes, fp32, on the machine it runs on.

Each entry is a preset at one size: inference (eval, no gradients) and a training step (forward, backward and an
AdamW step), batch 8 by default, random weights. The entries run in interleaved rounds, so load and clock drift hit
all of them alike; the table gives the median img/s over the rounds and names the CPU (``lscpu``'s model name,
family and model), the threads and PyTorch. The file name says which CPU wrote it:

    python benchmarks/cpu_sizes.py --out benchmarks/results/cpu_sizes_$(python benchmarks/cpu_sizes.py --cpu-slug).md
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

import vitkit
from vitkit.benchmarking.bench import cpu_name, publish

# (preset, image sizes): the small ViTs, the backbones the small-data recipes start from, and Swin-T
ENTRIES = [
    ("vit_tiny_patch16_224", (112, 224)),
    ("vit_small_patch16_224", (112, 224)),
    ("vit_base_patch16_224", (112, 224)),
    ("vit_small_patch14_dinov2", (112, 224, 518)),
    ("swin_tiny_patch4_window7_224", (224,)),
]


def cpu_slug() -> str:
    """The CPU as a file name: its model name and, from /proc/cpuinfo, its family and model (``amd-epyc-f26-m2``)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    model = re.search(r"^model\s*:\s*(\d+)", info, re.M)
    name = re.sub(r"\(r\)|\(tm\)|processor|cpu", "", cpu_name().lower())
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return name + (f"-f{family.group(1)}-m{model.group(1)}" if family and model else "")


def cpu_family() -> str:
    """``family F, model M`` of /proc/cpuinfo, which tells CPUs of one model name apart (an EPYC's Zen generation)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    model = re.search(r"^model\s*:\s*(\d+)", info, re.M)
    return f"family {family.group(1) if family else '?'}, model {model.group(1) if model else '?'}"


def build(name: str, size: int, train: bool):
    model = vitkit.create_model(name, num_classes=10, img_size=size).train(train)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    return model, opt


def step(model, opt, x: torch.Tensor, y: torch.Tensor) -> None:
    if opt is None:
        with torch.no_grad():
            model(x)
        return
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2, help="timed steps of each entry per round")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cpu-slug", action="store_true", help="print the CPU's name as the result file takes it, and exit")
    args = p.parse_args()
    if args.cpu_slug:
        print(cpu_slug())
        return
    torch.manual_seed(0)
    entries = [(name, size, train) for name, sizes in ENTRIES for size in sizes for train in (False, True)]
    built = {e: build(*e) for e in entries}
    data = {}
    for name, size, train in entries:  # a warm-up step each, which also sizes the inputs
        x = torch.randn(args.batch_size, 3, size, size)
        data[(name, size, train)] = x, torch.randint(0, 10, (args.batch_size,))
        step(*built[(name, size, train)], *data[(name, size, train)])
    seconds = {e: [] for e in entries}
    for _ in range(args.rounds):
        for e in entries:
            start = time.perf_counter()
            for _ in range(args.iters):
                step(*built[e], *data[e])
            seconds[e].append((time.perf_counter() - start) / args.iters)
    rows = {}
    for name, size, train in entries:
        ips = args.batch_size / statistics.median(seconds[(name, size, train)])
        rows.setdefault((name, size), {})["train" if train else "infer"] = ips
    lines = [f"CPU: {cpu_name()} ({cpu_family()}), "
             f"{torch.get_num_threads()} threads; torch {torch.__version__}; fp32, batch {args.batch_size}, median of "
             f"{args.rounds} interleaved rounds of {args.iters} steps; random weights", "",
             "| model | image size | inference img/s | training img/s |", "|---|---|---|---|"]
    for (name, size), r in rows.items():
        lines.append(f"| {name} | {size} | {r['infer']:.1f} | {r['train']:.1f} |")
    publish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
