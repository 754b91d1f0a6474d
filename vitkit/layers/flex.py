"""The ``flex`` backend of the attention core: ``flex_attention``, compiled once, with the bias as a
``score_mod`` and the boolean masks as a block mask that skips fully masked blocks.

PyTorch has no flex backward on CPU, and torch.compile cannot build flex for a CPU without AVX2; the core then
runs ``sdpa`` instead and says so once (``fallback_reason``).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
from torch import Tensor

from .masks import fold

log = logging.getLogger(__name__)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (the first compile takes ~15 s on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled function serves every layer shape and mask kind of the process (Swin alone has
    # several); past dynamo's default of 8 variants it would silently run the unfused fallback.
    # torch._dynamo.config has no public equivalent (checked on torch 2.14.1; tests/layers/test_attention.py
    # fails if the setting disappears).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def flex_runs_on_cpu() -> bool:
    """Whether torch.compile can build flex attention for this CPU: it needs AVX2 or better (the kernels
    ATen dispatches to, which ``ATEN_CPU_CAPABILITY`` may lower) and is not built on macOS."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX") and sys.platform != "darwin"


@functools.cache
def _warn_flex_fallback() -> None:
    log.warning("attn_backend='flex' has no backward on CPU; using 'sdpa' for forwards that need gradients")


@functools.cache
def _warn_flex_unsupported() -> None:
    log.warning("attn_backend='flex' cannot be compiled for this CPU (it needs AVX2; capability %s); using 'sdpa'",
                torch.backends.cpu.get_cpu_capability())


def flex(q: Tensor, k: Tensor, v: Tensor, *, scale: float, bias: Tensor | None, attn_mask: Tensor | None,
         key_padding_mask: Tensor | None, is_causal: bool, B: int, G: int) -> Tensor:
    """q (B·G, H, N, D), k and v (B·G, Hkv, M, D); the masks as ``Attention.forward`` takes them."""
    from torch.nn.attention.flex_attention import create_block_mask

    H, (N, M) = q.shape[1], (q.shape[-2], k.shape[-2])
    score_mod = None
    if bias is not None:
        fb = fold(bias, B, G, H, N, M)
        bb, bh = fb.shape[0] > 1, fb.shape[1] > 1

        def score_mod(score, b, h, qi, ki):
            return score + fb[b if bb else 0, h if bh else 0, qi, ki]

    conds = []
    if attn_mask is not None:
        fm = fold(attn_mask, B, G, H, N, M)
        mb, mh = fm.shape[0] > 1, fm.shape[1] > 1
        conds.append(lambda b, h, qi, ki: fm[b if mb else 0, h if mh else 0, qi, ki])
    if key_padding_mask is not None:
        keep_k = fold(~key_padding_mask[:, None, None, None, :], B, G, H, N, M)[:, 0, 0]  # (B·G, M)
        conds.append(lambda b, h, qi, ki: keep_k[b, ki])
    if is_causal:
        conds.append(lambda b, h, qi, ki: qi + (M - N) >= ki)
    block_mask = None
    if conds:
        def mask_mod(b, h, qi, ki):
            ok = conds[0](b, h, qi, ki)
            for c in conds[1:]:
                ok = ok & c(b, h, qi, ki)
            return ok

        per_b = key_padding_mask is not None or (attn_mask is not None and mb)
        per_h = attn_mask is not None and mh
        block_mask = create_block_mask(mask_mod, q.shape[0] if per_b else None, q.shape[1] if per_h else None,
                                       N, M, device=q.device)
    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=k.shape[1] != q.shape[1])
