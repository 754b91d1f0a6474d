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


class SwiGLU(nn.Module):
    """SiLU-gated feed-forward (Shazeer, 2020), as DINOv3's larger models and EVA-02 use: fc2(silu(fc1_g(x)) ·
    fc1_x(x)), with an optional LayerNorm on the hidden units (EVA-02's sub-LN); names as timm's ``SwiGLU``."""

    def __init__(self, dim: int, hidden_dim: int, *, drop: float = 0.0, norm: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden_dim)
        self.fc1_x = nn.Linear(dim, hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.LayerNorm(hidden_dim, eps=eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1_g(x)) * self.fc1_x(x)))))
