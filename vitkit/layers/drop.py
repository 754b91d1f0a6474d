"""Stochastic depth: drop a residual branch per sample during training."""

from __future__ import annotations

from torch import Tensor, nn

from vitkit.errors import UsageError


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016): zero a residual branch per sample, rescale the rest."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise UsageError(f"drop path rate must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)  # one draw per sample
        return x * x.new_empty(shape).bernoulli_(keep).div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic depth rising linearly from 0 at the first block to ``rate`` at the last."""
    if depth <= 1:
        return [0.0] * depth  # one block: nothing to rise over
    return [rate * i / (depth - 1) for i in range(depth)]
