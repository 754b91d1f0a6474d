"""What a teacher costs a training step: the student's step alone beside the same step with the teacher's forward
(no gradient) on the same batch, interleaved in one process, through ImageClassifier's own loss.

    python benchmarks/distill_cost.py --student deit_small_distilled_patch16_224 --teacher regnety_160 \
        --batch-size 8 --out benchmarks/results/distill_cost_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vitkit.lit import ImageClassifier, Teacher


def step_time(module: ImageClassifier, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        opt.zero_grad(set_to_none=True)
        loss = module._loss(x, y)
        loss.backward()
        opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", default="deit_small_distilled_patch16_224")
    p.add_argument("--teacher", default="regnety_160", help="a timm model name (random weights: only time counts)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import timm

    device = torch.device(args.device)
    teacher = timm.create_model(args.teacher, num_classes=1000)
    path = Path(tempfile.mkdtemp()) / f"{args.teacher}.pth"
    torch.save(teacher.state_dict(), path)
    alone = ImageClassifier(args.student, num_classes=1000).to(device).train()
    teacher = Teacher(args.teacher, checkpoint=str(path), distillation="hard")
    taught = ImageClassifier(args.student, num_classes=1000, teacher=teacher).to(device).train()
    taught._teacher.to(device)
    x = torch.randn(args.batch_size, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (alone, taught)}
    times: dict[str, list[float]] = {"student alone": [], "with the teacher": []}
    for r in range(args.rounds + 1):  # the first round warms up
        order = [(alone, "student alone"), (taught, "with the teacher")][:: 1 if r % 2 else -1]
        for module, name in order:
            t = step_time(module, opts[module], x, y, args.iters)
            if r:
                times[name].append(t)
    a, b = (statistics.median(times[k]) for k in times)
    cpu = platform.processor() or platform.machine()
    lines = [f"# Distillation step cost: {args.student} taught by {args.teacher}", "",
             f"{args.device} ({cpu}), batch {args.batch_size}, fp32, {args.rounds} interleaved rounds of {args.iters} "
             f"steps, torch {torch.__version__}", "", "| step | s / step | img/s |", "|---|---|---|",
             f"| student alone | {a:.3f} | {args.batch_size / a:.2f} |",
             f"| with the teacher's forward | {b:.3f} | {args.batch_size / b:.2f} |", "",
             f"The teacher adds {100 * (b / a - 1):.0f}% to a step."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
