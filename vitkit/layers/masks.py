"""Masks of the attention core: causal, and the (B, G, H, N, M) layout that folds groups into the batch."""

from __future__ import annotations

import torch
from torch import Tensor

from vitkit.errors import UsageError


def causal(N: int, M: int, device: torch.device) -> Tensor:
    """(N, M) bool, query i sits at key position M - N + i (bottom-right aligned)."""
    return torch.ones(N, M, dtype=torch.bool, device=device).tril(diagonal=M - N)


def unfold(t: Tensor) -> Tensor:
    """A (B, H, N, M)-broadcastable mask with a group axis added; (B, G, H, N, M) ones pass as they are."""
    if t.dim() > 4:
        return t
    return t.reshape([1] * (4 - t.dim()) + list(t.shape)).unsqueeze(1)


def fold(t: Tensor, B: int, G: int, H: int, N: int, M: int) -> Tensor:
    """(B, H, N, M)- or (B, G, H, N, M)-broadcastable -> (B·G|1, H|1, N, M) for the folded batch.

    Stays a broadcast view unless it varies with the group; then it is expanded to B·G rows."""
    t = unfold(t)
    b, g, h = t.shape[0], t.shape[1], t.shape[2]
    nm = list(t.shape[-2:])
    if G == 1 or (g == 1 and b == 1):
        return t.reshape([b, h] + nm)
    return t.expand([B, G, h] + nm).reshape([B * G, h] + nm)


def merge(bias: Tensor | None, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool,
          B: int, N: int, M: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """(one mask, the boolean part of it): the mask is float if there is a bias (masked entries -inf),
    else bool (True = attend), else None; both broadcastable to (B, G, H, N, M), not yet folded.

    Plain causal attention is left to the kernel's own flag, which keeps flash eligible."""
    keep: Tensor | None = None
    if attn_mask is not None:
        keep = unfold(attn_mask)
    if key_padding_mask is not None:
        if list(key_padding_mask.shape) != [B, M]:
            shape = ", ".join([str(s) for s in key_padding_mask.shape])
            raise UsageError(f"key_padding_mask must have shape (B, M) = ({B}, {M}), got ({shape})")
        pad = ~key_padding_mask[:, None, None, None, :]  # (B, 1, 1, 1, M)
        keep = pad if keep is None else keep & pad
    if is_causal and (keep is not None or bias is not None):
        c = causal(N, M, device)
        keep = c if keep is None else keep & c
    if bias is None:
        return keep, keep
    bias = unfold(bias)
    return (bias if keep is None else bias.masked_fill(~keep, float("-inf"))), keep
