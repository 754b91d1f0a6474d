"""Token merging (ToMe; Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023), for ViT's blocks.

In a block, between attention and the MLP, the r most similar pairs of tokens are merged: the tokens alternate
between two sets A and B (by their index in the whole sequence, as published), each A token is matched to its
most similar B token by the cosine similarity of their keys (averaged over heads), and the r best-matched A tokens
are averaged into their B partners, weighted by how many patches each already holds (its size). Attention then adds
log(size) to the scores ("proportional attention"): that is an additive bias to the one attention core, so the
fused kernels keep running it. The prefix tokens (class, distillation, registers) are never merged and stay first.

Tokens after a merge: the prefix, the unmerged A tokens in their order, then the B tokens (ToMe's order for a
class token, and for DeiT's class and distillation tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitkit.errors import UsageError, UsageTypeError

TokenMerging = int | tuple[int, float] | list[int]


def merge_schedule(r: TokenMerging, depth: int) -> list[int]:
    """Tokens merged in each of ``depth`` blocks: an int for every block; ``(r, inflection)`` ToMe's linear
    schedule (r·(1 - inflection) in the first block up to r·(1 + inflection) in the last); a list, one per block."""
    if isinstance(r, bool) or not isinstance(r, (int, tuple, list)):
        raise UsageTypeError(f"token_merging must be an int, an (r, inflection) pair or a list of ints per block, "
                             f"got {r!r}")
    if isinstance(r, int):
        out = [r] * depth
    elif isinstance(r, tuple):
        if len(r) != 2:
            raise UsageError(f"token_merging as a tuple is (r, inflection), got {r!r}")
        lo = int(r[0] * (1.0 - r[1]))
        hi = 2 * r[0] - lo
        out = [int(lo + (hi - lo) * i / max(depth - 1, 1)) for i in range(depth)]
    else:
        if len(r) > depth or not all(isinstance(v, int) and not isinstance(v, bool) for v in r):
            raise UsageError(f"token_merging as a list gives one int per block (at most {depth}), got {r!r}")
        out = list(r) + [0] * (depth - len(r))
    if any(v < 0 for v in out):
        raise UsageError(f"token_merging must not be negative, got {r!r}")
    return out


def proportional_bias(size: Tensor | None) -> Tensor | None:
    """log(size) of each key, (B, 1, 1, N): what proportional attention adds to the scores; None before a merge."""
    return None if size is None else size.log()[:, None, None, :, 0]


def bipartite_merge(x: Tensor, metric: Tensor, size: Tensor | None, r: int, num_prefix: int,
                    where: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Merge r pairs of tokens of x (B, N, C) by the similarity of ``metric`` (B, N, D), a size-weighted mean.

    ``size`` (B, N, 1) counts the patches each token holds (None: one each). ``where`` (B, N0), the token each
    original token is now part of, is carried along when given. Returns (x, size, where) with N - r tokens;
    at most half of the patch tokens merge in one block."""
    B, N, C = x.shape
    p = num_prefix
    r = min(r, (N - p) // 2)
    if size is None:
        size = torch.ones(B, N, 1, dtype=x.dtype, device=x.device)
    if r <= 0:
        return x, size, where
    s = p % 2  # A holds the even indices of the whole sequence: the first patch is in A when p is even
    m = metric[:, p:].detach()  # the matching is a choice, not a function to differentiate
    m = m / torch.linalg.vector_norm(m, dim=-1, keepdim=True)
    scores = m[:, s::2] @ m[:, 1 - s::2].transpose(-1, -2)  # (B, Na, Nb)
    best, partner = scores.max(dim=-1)  # each A token's most similar B token
    order = best.argsort(dim=-1, descending=True)[..., None]  # (B, Na, 1)
    src = order[:, :r]  # the r A tokens that merge away ...
    dst = partner[..., None].gather(1, src)  # ... into these B tokens
    keep = order[:, r:].sort(dim=1)[0]  # the other A tokens, in their order
    if where is not None:
        where = _moved(where, src[..., 0], dst[..., 0], keep[..., 0], N, p, s)
    x, size = _merge(x * size, src, dst, keep, p, s), _merge(size, src, dst, keep, p, s)
    return x / size, size, where


def _merge(t: Tensor, src: Tensor, dst: Tensor, keep: Tensor, p: int, s: int) -> Tensor:
    """Sum each merged A token of t (B, N, c) into its B partner: (B, N - r, c), the prefix first, then the kept A
    tokens, then the B tokens."""
    B, r, c = t.shape[0], src.shape[1], t.shape[-1]
    a, b = t[:, p:][:, s::2], t[:, p:][:, 1 - s::2]
    b = b.scatter_reduce(1, dst.expand(B, r, c), a.gather(1, src.expand(B, r, c)), reduce="sum")
    return torch.cat([t[:, :p], a.gather(1, keep.expand(B, keep.shape[1], c)), b], dim=1)


def _moved(where: Tensor, src: Tensor, dst: Tensor, keep: Tensor, N: int, p: int, s: int) -> Tensor:
    """``where`` after a merge: each token's new index (prefix unchanged, kept A tokens next, B tokens last, merged
    A tokens at their B partner's), looked up for every original token."""
    B, kept = where.shape[0], keep.shape[1]
    new = torch.arange(N, device=where.device).expand(B, N).clone()
    a_new = torch.empty_like(new[:, p:][:, s::2])
    a_new.scatter_(1, keep, p + torch.arange(kept, device=where.device).expand(B, kept))
    a_new.scatter_(1, src, p + kept + dst)
    b_count = new[:, p:][:, 1 - s::2].shape[1]
    new[:, p + s::2] = a_new
    new[:, p + 1 - s::2] = p + kept + torch.arange(b_count, device=where.device).expand(B, b_count)
    return new.gather(1, where)
