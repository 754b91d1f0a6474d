"""Backbone outputs in timm's interface: which blocks to take, and a ``features_only`` wrapper.

Detection and segmentation frameworks call a timm backbone as ``model(x) -> [maps]`` and read
``model.feature_info.channels()`` / ``.reduction()``; :class:`FeatureNet` gives a vitkit model that shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError


def take_indices(num: int, indices: int | Sequence[int] | None) -> tuple[list[int], int]:
    """(absolute indices, largest) of the blocks/stages to return: all for None, the last n for an int,
    the listed ones (negative counts from the end) for a sequence; as timm's ``feature_take_indices``."""
    if indices is None:
        indices = num
    if isinstance(indices, int):
        if not 0 < indices <= num:
            raise UsageError(f"the last {indices} of {num} blocks/stages: expected 1 to {num}")
        taken = list(range(num - indices, num))
    else:
        taken = []
        for i in indices:
            j = num + i if i < 0 else i
            if not 0 <= j < num:
                raise IndexError(f"feature index {i} is out of range for {num} blocks/stages")
            taken.append(j)
    return taken, max(taken)


class FeatureInfo(list):
    """One dict per output (num_chs, reduction, module), with timm's accessors."""

    def _get(self, key: str, idx: int | Sequence[int] | None):
        if idx is None:
            return [f[key] for f in self]
        return self[idx][key] if isinstance(idx, int) else [self[i][key] for i in idx]

    def channels(self, idx: int | Sequence[int] | None = None):
        return self._get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None):
        return self._get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None):
        return self._get("module", idx)


def default_out_indices(model: nn.Module, out_indices: int | Sequence[int] | None) -> list[int]:
    """The blocks/stages a backbone returns: ``out_indices`` as :func:`take_indices` reads it, and by default
    timm's choice, every stage of Swin and the last 3 blocks of ViT."""
    num = len(model.feature_info)
    if out_indices is None:
        out_indices = tuple(range(num)) if model.output_fmts[0] == "NHWC" else min(3, num)
    return take_indices(num, out_indices)[0]


class FeatureNet(nn.Module):
    """A model cut after its last needed block, returning the maps of ``out_indices`` (timm's features_only).

    ``output_fmt``: ``NCHW`` or ``NHWC`` (Swin's default, as timm's), ``NLC`` for ViT tokens."""

    def __init__(self, model: nn.Module, out_indices: int | Sequence[int] | None = None,
                 output_fmt: str | None = None, norm: bool = False) -> None:
        super().__init__()
        fmts = model.output_fmts
        self.output_fmt = output_fmt or fmts[0]
        if self.output_fmt not in fmts:
            raise UsageError(f"{model.name}: output_fmt must be one of {fmts}, got {output_fmt!r}")
        self.out_indices = model.prune_intermediate_layers(default_out_indices(model, out_indices),
                                                           prune_norm=not norm)
        self.feature_info = FeatureInfo(model.feature_info[i] for i in self.out_indices)
        self.norm = norm
        self.model = model
        self.name = getattr(model, "name", type(model).__name__)
        self.pretrained_cfg = self.default_cfg = getattr(model, "pretrained_cfg", None)

    def forward(self, x: Tensor) -> list[Tensor]:
        return self.model.forward_intermediates(x, indices=self.out_indices, norm=self.norm, stop_early=True,
                                                output_fmt=self.output_fmt, intermediates_only=True)


def resample_patch_embed(weight: Tensor, new_size: tuple[int, int]) -> Tensor:
    """A patch-embedding kernel (C, C_in, p, p) for another patch size, so that patches resized with it
    give the same tokens (FlexiViT's pseudo-inverse resize, Beyer et al., 2023; timm does the same)."""
    old = tuple(weight.shape[-2:])
    if old == tuple(new_size):
        return weight
    eye = torch.eye(old[0] * old[1], dtype=torch.float32).view(-1, 1, *old)  # one basis image per pixel
    resize = F.interpolate(eye, size=new_size, mode="bicubic", antialias=True)  # (p·p, 1, p', p')
    mat = resize.flatten(1).T.double()  # (p'·p', p·p): resizing as a matrix
    w = weight.double().flatten(2) @ torch.linalg.pinv(mat)  # (C, C_in, p'·p')
    return w.view(*weight.shape[:2], *new_size).to(weight.dtype)


def new_head(dim: int, num_classes: int, like: Tensor) -> nn.Module:
    """A fresh classifier (truncated normal 0.02, zero bias) on ``like``'s device and dtype; none for 0 classes."""
    if num_classes <= 0:
        return nn.Identity()
    head = nn.Linear(dim, num_classes, device=like.device, dtype=like.dtype)
    nn.init.trunc_normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    return head


@torch.no_grad()
def resize_patch_conv(patch_embed: nn.Module, patch_size: int) -> None:
    """Give ``patch_embed.proj`` another patch size (kernel = stride), its kernel resized as above."""
    old = patch_embed.proj
    new = nn.Conv2d(old.in_channels, old.out_channels, patch_size, patch_size, device=old.weight.device,
                    dtype=old.weight.dtype)
    new.weight.copy_(resample_patch_embed(old.weight, (patch_size, patch_size)))
    new.bias.copy_(old.bias)
    new.requires_grad_(old.weight.requires_grad)
    patch_embed.proj, patch_embed.patch_size = new, patch_size
