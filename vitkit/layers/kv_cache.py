"""The decoder's caches, read by the attention core: past keys and values of self-attention, written in place
into buffers allocated once, and the memory's keys and values of cross-attention, projected once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vitkit.errors import UsageError


class KVCache:
    """Keys and values of past decoder steps in pre-allocated buffers (B, Hkv, S, D), written in place.

    The S slots hold a whole sequence of up to ``size`` tokens, or, with ``window``, the last ``window``
    positions as a ring buffer (sliding-window attention), as litgpt's cache does. The buffers are allocated at
    the first step, from its keys; after that every shape is fixed and the position counter is a tensor, so a
    compiled decode step is compiled once, not once per step.
    """

    def __init__(self, size: int, window: int | None = None) -> None:
        self.window = window
        self.size = size if window is None else window  # S
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None  # (S,) the absolute position each slot holds; -1 = empty
        self.next: Tensor | None = None  # () the absolute position of the next token
        self._written = 0  # host-side count, for the capacity check outside torch.compile

    @property
    def length(self) -> int:
        """Keys the cache holds now."""
        return 0 if self.pos is None else int((self.pos >= 0).sum())

    def allocate(self, B: int, Hkv: int, D: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(B, Hkv, self.size, D, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.next = torch.zeros((), dtype=torch.long, device=device)

    def positions(self, T: int) -> tuple[Tensor, Tensor]:
        """(query positions (T,), key positions (S,) once T more tokens are written) of an allocated cache;
        changes nothing."""
        q_pos = self.next + torch.arange(T, device=self.next.device)
        return q_pos, self.pos.index_copy(0, q_pos % self.size, q_pos)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write this step's k and v (B, Hkv, T, D); return all keys and values (B, Hkv, S, D) and which of
        them each new query may attend, (T, S) bool: written, not ahead of it, and inside the window."""
        B, Hkv, T, D = k.shape
        if not torch.compiler.is_compiling():
            self._check_room(T)
        if self.k is None:
            self.allocate(B, Hkv, D, k.dtype, k.device)
        q_pos, key_pos = self.positions(T)
        slots = q_pos % self.size
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        self.pos.copy_(key_pos)
        self.next.add_(T)
        keep = (key_pos >= 0) & (key_pos <= q_pos[:, None])  # (T, S)
        if self.window is not None:
            keep &= q_pos[:, None] - key_pos < self.window
        return self.k, self.v, keep

    def _check_room(self, T: int) -> None:
        if self.window is None and self._written + T > self.size:
            raise UsageError(f"the KV cache holds {self.size} tokens; {self._written} are written and a step "
                             f"of {T} more does not fit (start the decoding state with a larger size)")
        if self.window is not None and T > 1 and self._written + T > self.window:
            raise UsageError(f"with a sliding window of {self.window} a cached step past the window takes one "
                             f"token, got {T}")
        self._written += T

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search), in place."""
        if self.k is not None:
            self.k.copy_(self.k.index_select(0, index))
            self.v.copy_(self.v.index_select(0, index))


@dataclass
class MemoryKV:
    """Cross-attention keys and values of the encoder's memory, (B, Hkv, M, D) each: projected at the first
    decode step (or up front) and read by every step after it."""

    k: Tensor | None = None
    v: Tensor | None = None
