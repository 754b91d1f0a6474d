"""Image to patch tokens."""

from __future__ import annotations

from torch import Tensor, nn


class PatchEmbed(nn.Module):
    """Non-overlapping patches by a conv with stride = patch (Dosovitskiy et al., 2021).

    Returns tokens (B, N, C) by default, or a channels-last map (B, H', W', C) with ``flatten=False``
    (Swin). ``norm`` adds a LayerNorm after the projection, as Swin does."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, *, norm: bool = False,
                 flatten: bool = True, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.patch_size, self.in_chans, self.flatten = patch_size, in_chans, flatten
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = nn.LayerNorm(embed_dim, eps=eps) if norm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x).permute(0, 2, 3, 1)  # (B, H', W', C)
        if self.flatten:
            x = x.flatten(1, 2)  # (B, N, C)
        return self.norm(x)
