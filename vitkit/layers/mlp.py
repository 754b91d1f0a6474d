"""The position-wise feed-forward network of a transformer block."""

from __future__ import annotations

from torch import Tensor, nn


class Mlp(nn.Module):
    """Linear -> GELU -> Linear with dropout (Vaswani et al., 2017; GELU as in ViT, Dosovitskiy et al., 2021)."""

    def __init__(self, dim: int, hidden_dim: int, *, drop: float = 0.0, act: type[nn.Module] = nn.GELU,
                 out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))
