"""``attn_backend="auto"`` on the CPU: the candidate paths timed where they run, as cuDNN's benchmark mode times
its convolution kernels. The first call of each kind (dtype, grad mode, mask kind, heads, head size, and the query
and key lengths rounded up to powers of two; not the batch) runs every candidate a few times on that call's own
inputs and keeps the fastest for the process; every later call of that kind is a dictionary look-up.

Nothing is timed while a graph is traced (torch.compile, torch.export, TorchScript, ONNX), under a dispatch mode
(the FLOP counter, fake tensors), or while deterministic algorithms are on (``torch.use_deterministic_algorithms``,
Lightning's ``Trainer(deterministic=True)``): there the caller's static rule decides, so a traced graph never
depends on a measurement, and two runs of one program (an interrupted run and its resumption, the ranks of a job)
run the same paths whatever the machine's load. A model whose backend is ``sdpa`` or ``math`` is never timed."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode  # no public query (tests/layers hold it)

from .kernels import static_backend

log = logging.getLogger(__name__)

_chosen: dict[Hashable, str] = {}  # what each kind of call runs in this process

MARGIN = 0.10  # another path replaces the preferred one only when it is this much faster: a tie keeps the default
ROUNDS = 5  # timed calls of each candidate after one warm-up call, alternating; their median counts


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two: the lengths of one kind of call (a growing cache, dropped tokens)."""
    return 1 << max(n - 1, 0).bit_length()


def can_time() -> bool:
    """Whether the current call may be timed: not while a graph is traced, a dispatch mode is active or
    deterministic algorithms are on."""
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if torch.are_deterministic_algorithms_enabled():  # a timed choice could differ between two runs
        return False
    return _get_current_dispatch_mode() is None


def chosen(key: Hashable) -> str | None:
    """The path kept for this kind of call, or None before its first call."""
    return _chosen.get(key)


def choose(key: Hashable, candidates: dict[str, Callable[[], object]], prefer: str) -> str:
    """Time ``candidates`` (name -> a call of that path on this call's inputs), keep and return the fastest by median;
    ``prefer`` (one of them) stays unless another is faster by more than ``MARGIN``. Rounds alternate the order, so
    drift in the machine's speed hits every candidate alike."""
    for run in candidates.values():
        run()  # warm-up: first-call allocations and kernel set-up are not what a later call pays
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(ROUNDS):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - t0)
    best = {name: statistics.median(t) for name, t in times.items()}  # a shared machine's bursts: not one call's
    fastest = min(best, key=best.__getitem__)
    pick = fastest if best[fastest] < best[prefer] * (1 - MARGIN) else prefer
    _chosen[key] = pick
    log.debug("attention auto %s: %s (%s)", key, pick, ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in best.items()))
    return pick


def auto_backend(q: Tensor, k: Tensor, v: Tensor, call: Any, learned_bias: bool,
                 backends: dict[str, Callable]) -> str:
    """What ``auto`` runs for this CPU call of the attention core: the path of ``backends`` (``sdpa``, ``math``) the
    first call of its kind measured faster, or in a traced graph the static rule. The kind: dtype, grad mode, a
    learned bias, the mask's kind, heads and head size, the lengths rounded up to powers of two."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or learned_bias)
    if not can_time():
        return static_backend(q, learned_bias)
    m = call.mask
    _, H, N, D = q.shape  # not the batch: one path for every batch size, so memory per image stays the same
    key = (q.dtype, grad, learned_bias, None if m is None else m.dtype, call.is_causal, H, k.shape[1], bucket(N),
           bucket(k.shape[-2]), D)
    return chosen(key) or choose(
        key, {name: trial(backends[name], q, k, v, call, grad, learned_bias) for name in ("sdpa", "math")}, "sdpa")


def trial(fn: Callable, q: Tensor, k: Tensor, v: Tensor, call: Any, grad: bool,
          learned_bias: bool) -> Callable[[], None]:
    """One call of backend ``fn`` on this call's inputs, as training or inference runs it: on detached copies,
    without dropout (no random numbers drawn) and outside any saved-tensor hooks of the caller (activation
    checkpointing counts what a forward saves). ``call``: the core's dataclass of masks and sizes."""
    call = dataclasses.replace(call, dropout_p=0.0)
    if not grad:
        def infer() -> None:
            with torch.no_grad():
                fn(q, k, v, call)
        return infer
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if learned_bias and call.mask is not None and call.mask.is_floating_point():
        call = dataclasses.replace(call, mask=call.mask.detach().requires_grad_())
        leaves.append(call.mask)

    def train() -> None:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            o = fn(*leaves[:3], call)[0]
            torch.autograd.grad(o, leaves, torch.ones_like(o))
    return train


def choices() -> dict[Hashable, str]:
    """What each kind of call timed so far runs (a copy)."""
    return dict(_chosen)


def reset() -> None:
    """Forget every choice (the next call of each kind is timed again)."""
    _chosen.clear()
