"""Per-channel scaling of a residual branch."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LayerScale(nn.Module):
    """LayerScale (Touvron et al., 2021, CaiT): a learned per-channel gain, initialised small."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))  # name as in timm checkpoints

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma
