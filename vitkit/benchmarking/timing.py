"""Timing a model's steps as the bench does: build, warm up (halving the batch on OOM), then time every entry
once per round, interleaved, so that clock and load drift hit all of them alike. ``vitkit bench`` times the
libraries with it, ``vitkit bench --checkpoint`` each token-merging value."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vitkit.errors import UsageError


@dataclass
class Entry:
    library: str
    model: str
    mode: str
    batch_size: int
    factory: Callable[[], nn.Module] = field(repr=False)
    input_shape: tuple[int, int, int] = (3, 224, 224)
    net: nn.Module | None = field(default=None, repr=False)
    step: Callable[[], None] | None = field(default=None, repr=False)
    times: list[float] = field(default_factory=list)
    oom_backoff: int = 0  # how many times the batch was halved
    token_merging: int = 0  # vitkit's ToMe: token pairs merged per block

    @property
    def label(self) -> str:
        return f"{self.library} r={self.token_merging}" if self.token_merging else self.library


def autocast_ctx(precision: str, device: torch.device):
    if precision == "amp_bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def prepare(e: Entry, args, device: torch.device) -> None:
    """Build the model and a closure that runs one inference or training step."""
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    net = e.factory().to(device=device, dtype=dtype)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    net = net.to(memory_format=memory_format)
    if args.grad_checkpointing:
        if not hasattr(net, "set_grad_checkpointing"):
            raise UsageError(f"--grad-checkpointing: {e.library}'s {e.model} has no set_grad_checkpointing()")
        net.set_grad_checkpointing(True)
    x = torch.randn(e.batch_size, *e.input_shape, device=device, dtype=dtype).to(memory_format=memory_format)
    run = torch.compile(net) if args.compile else net
    ctx = lambda: autocast_ctx(args.precision, device)  # noqa: E731
    if e.mode == "infer":
        net.eval()

        def step() -> None:
            with torch.no_grad(), ctx():
                run(x)
    else:
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        target = torch.randint(0, 1000, (e.batch_size,), device=device)

        def step() -> None:
            with ctx():
                loss = nn.functional.cross_entropy(run(x).float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    e.net, e.step = net, step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def warm_up(e: Entry, args, device: torch.device) -> None:
    """Build and run the warm-up steps, halving the batch on OOM."""
    while True:
        try:
            prepare(e, args, device)
            for _ in range(args.warmup):
                e.step()
            sync(device)
            return
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not is_oom(err) or e.batch_size == 1:
                raise
            e.net = e.step = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            e.batch_size //= 2
            e.oom_backoff += 1
            print(f"  OOM: {e.library} {e.model} {e.mode}: batch halved to {e.batch_size}", file=sys.stderr)


def time_rounds(entries: list[Entry], args, device: torch.device) -> None:
    """Time the warmed-up entries' steps into ``e.times``, interleaved: every entry once per round, in the reverse
    order every other round: in one process a step runs at a different speed right after another model's step
    than first, so a fixed order would give the model listed first a lasting advantage or handicap."""
    for r in range(args.rounds):
        for e in entries if r % 2 == 0 else entries[::-1]:
            for _ in range(args.iters):
                sync(device)
                t0 = time.perf_counter()
                e.step()
                sync(device)
                e.times.append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
