"""An MAE training step beside a classifier training step of the same ViT: images per second, interleaved in one
process, beside the ratio of their multiply-adds (forward + backward, counted on the meta device), and the peak
activation memory per image of each (counted by a saved-tensors hook, see ``activation_mib``).

The encoder of MAE sees a quarter of the patches (mask ratio 0.75); its decoder (512 wide, 8 blocks by default)
sees every position. So a step does far less work than a classifier step: the ratio of multiply-adds is about
1.8 for ViT-B/16 and about 3 for ViT-L/16, and the measured speed-up should reach most of it. The speed-up is
taken in each round (the two steps back to back) and its median printed with its range.

    python benchmarks/mae_speed.py --models vit_base_patch16_224,vit_large_patch16_224 --batch-size 32 --rounds 5 \
        --iters 1 --out benchmarks/results/mae_speed_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import vitkit
from vitkit.benchmarking.flops import count_gmacs_of, saved_activations_mib
from vitkit.layers import Attention
from vitkit.training.optim import build_adamw


def build(kind: str, name: str):
    if kind == "mae":
        return vitkit.create_mim(name, objective="mae")
    return vitkit.create_model(name, num_classes=1000)


def step_fn(kind: str, model, batch: int, size: int, precision: str, device: torch.device):
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    opt = build_adamw(model, lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95), layer_decay=None)  # as the modules do
    ctx = (lambda: torch.autocast(device.type, torch.bfloat16)) if precision == "amp_bf16" else torch.enable_grad

    def step() -> None:
        with ctx():
            out = model(x)
            loss = out.loss if kind == "mae" else torch.nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def gmacs(kind: str, name: str, size: int) -> float:
    """Multiply-adds of one training step per image (forward and backward)."""
    if kind == "mae":
        cfg = vitkit.create_mim(name, objective="mae").cfg

        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = vitkit.create_mim(name, objective="mae", mim={"mask_ratio": cfg.mask_ratio})

            def forward(self, x):
                return self.m(x).loss

        return count_gmacs_of(Loss, (3, size, size), train=True)
    return count_gmacs_of(lambda: vitkit.create_model(name, num_classes=1000), (3, size, size), train=True)


def activation_mib(kind: str, name: str, size: int, precision: str, device: torch.device, batch: int = 2) -> float:
    """MiB per image that autograd keeps for the backward pass (the activations, on the fused attention path): the
    saved tensors of a forward
    of ``2 * batch`` images minus those of ``batch``, over ``batch``; the weights (and autocast's copies of them),
    kept alike by both, cancel. It grows linearly with the batch, so two images tell it for any batch without
    holding a big one's activations.

    The whole step's peak is this times the batch plus the model state (weights, gradients, AdamW's two moments:
    16 bytes a parameter in fp32). Peak RSS was tried first and is the wrong probe on CPU: at batch 8 the
    optimizer step's temporaries set the peak, the same for both kinds of step."""
    torch.manual_seed(0)
    model = build(kind, name).to(device).train()
    for module in model.modules():  # the fused path for every count: on a CPU "auto" times the paths per shape and
        if isinstance(module, Attention):  # may take the math path, which also keeps the attention weights, for one
            module.backend = "sdpa"  # batch size and not for the other
    ctx = (lambda: torch.autocast(device.type, torch.bfloat16)) if precision == "amp_bf16" else torch.enable_grad
    with ctx():
        two, one = (saved_activations_mib(model, torch.randn(n, 3, size, size, device=device))
                    for n in (2 * batch, batch))
    return (two - one) / batch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit_base_patch16_224,vit_large_patch16_224")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--precision", choices=["fp32", "amp_bf16"], default="fp32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-mem", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    for flag in ("batch_size", "rounds", "iters"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} expects a whole number >= 1, got {getattr(args, flag)}")
    device = torch.device(args.device)
    head = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, device {device}, batch {args.batch_size}, {args.img_size} px, {args.precision}")
    rows = [head, "", "| model | classifier img/s | MAE img/s | measured speed-up (rounds' range) | MAC ratio |"
            " speed-up / MAC ratio | classifier activations MiB/img | MAE activations MiB/img |"
            " model state MiB, classifier / MAE |",
            "|---|---|---|---|---|---|---|---|---|"]
    print(head)
    for name in args.models.split(","):
        steps, times = {}, {"cls": [], "mae": []}
        for kind in ("cls", "mae"):
            torch.manual_seed(0)
            steps[kind] = step_fn(kind, build(kind, name).to(device).train(), args.batch_size, args.img_size,
                                  args.precision, device)
            steps[kind]()  # warm-up
        for r in range(args.rounds):
            for kind in (("cls", "mae") if r % 2 == 0 else ("mae", "cls")):
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    steps[kind]()
                times[kind].append(args.batch_size * args.iters / (time.perf_counter() - t0))
        ips = {k: statistics.median(v) for k, v in times.items()}
        ratio = gmacs("cls", name, args.img_size) / gmacs("mae", name, args.img_size)
        # The speed-up of each round (its two steps ran back to back, so a change in the machine's load between
        # rounds cancels), the median over rounds, and their range.
        rounds = [m / c for m, c in zip(times["mae"], times["cls"], strict=True)]
        speed = statistics.median(rounds)
        mem = {k: "-" if args.no_mem else
               f"{activation_mib(k, name, args.img_size, args.precision, device):.1f}"
               for k in ("cls", "mae")}
        with torch.device("meta"):
            state = {k: sum(p.numel() for p in build(k, name).parameters()) * 16 / 2**20 for k in ("cls", "mae")}
        row = (f"| {name} | {ips['cls']:.2f} | {ips['mae']:.2f} | {speed:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) | "
               f"{ratio:.2f} | {speed / ratio:.2f} | "
               f"{mem['cls']} | {mem['mae']} | {state['cls']:.0f} / {state['mae']:.0f} |")
        rows.append(row)
        print(row, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
