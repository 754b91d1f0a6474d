"""The position-wise feed-forward network of a transformer block, and the activations presets name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn


class QuickGELU(nn.Module):
    """x·sigmoid(1.702·x): the GELU approximation OpenAI's CLIP was trained with (Radford et al., 2021)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


# activation names of the configs (timm's act_layer names) -> module factories
ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": partial(nn.GELU, approximate="tanh"), "quick_gelu": QuickGELU}


class Mlp(nn.Module):
    """Linear -> GELU -> Linear with dropout (Vaswani et al., 2017; GELU as in ViT, Dosovitskiy et al., 2021)."""

    def __init__(self, dim: int, hidden_dim: int, *, drop: float = 0.0, act: Callable[[], nn.Module] = nn.GELU,
                 out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))
