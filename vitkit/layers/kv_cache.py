"""The decoder's cache of past keys and values, read by the attention core."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Keys and values of past decoder steps, (B, Hkv, T, D) each. Each step's keys are concatenated to the
    cache (a new tensor per step, not written in place).

    ``window`` trims the cache to the last ``window`` positions (sliding-window attention).
    ``static`` marks cross-attention memory K/V that are computed once and then reused.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    window: int | None = None
    static: bool = False
    offset: int = 0  # absolute position of the first cached key (> 0 once the window trims)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        if self.window is not None and self.k.shape[-2] > self.window:
            drop = self.k.shape[-2] - self.window
            self.k, self.v = self.k[..., drop:, :], self.v[..., drop:, :]
            self.offset += drop
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
