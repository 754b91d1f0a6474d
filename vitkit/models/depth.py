"""Depth from one image on any plain vitkit ViT: :class:`DepthModel` runs four layers' maps (``forward_intermediates``
through the backbone's final norm, as Depth Anything's heads read them, or without it, as DPT's and DINOv2's) through
a depth head to a depth map (B, H, W) at the input's size: relative (affine-invariant inverse depth, MiDaS's and Depth
Anything's) or metric (metres up to ``max_depth``). The heads: DPT's (``vitkit.models.heads.DPTDepthHead``), a linear
probe (``LinearDepthHead``) and DINOv2's published linear heads with depth bins (:class:`BinsDepthHead`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitkit.errors import UsageError

from .dense import DenseModel, is_hierarchical, layer_indices
from .heads import DPTDepthHead, LinearDepthHead

HEAD_KINDS = ("dpt", "linear", "bins")


class BinsDepthHead(nn.Module):
    """DINOv2's linear depth heads (``dinov2_vit*14_{nyu,kitti}_linear[4]_head.pth``, Meta's ``BNHead`` with
    ``classify=True``): each layer's map concatenated with its class token, all resized to ``upsample`` times the
    first map's size and concatenated, a 1x1 conv to ``bins`` scores per pixel, the scores made a distribution
    (ReLU plus 0.1, normalised: AdaBins' "linear"), and the depth their expectation over ``bins`` depths evenly spaced
    from ``min_depth`` to ``max_depth``, clamped to that range. Metric depth; the name ``conv_depth`` is Meta's."""

    kind = "metric"
    reads_class_token = True
    at_input_size = False  # at 4x the patch grid: the model resizes it to the input

    def __init__(self, in_channels: Sequence[int], bins: int = 256, min_depth: float = 1e-3, max_depth: float = 10.0,
                 upsample: int = 4) -> None:
        super().__init__()
        self.min_depth, self.max_depth, self.upsample = float(min_depth), float(max_depth), upsample
        self.conv_depth = nn.Conv2d(2 * sum(in_channels), bins, 1)
        self.register_buffer("depths", torch.linspace(min_depth, max_depth, bins), persistent=False)

    def forward(self, maps: Sequence[tuple[Tensor, Tensor]], size: Sequence[int]) -> Tensor:
        h, w = maps[0][0].shape[-2:]
        x = torch.cat([F.interpolate(torch.cat([m, t[:, :, None, None].expand_as(m)], dim=1),
                                     size=(h * self.upsample, w * self.upsample), mode="bilinear",
                                     align_corners=False) for m, t in maps], dim=1)
        p = F.relu(self.conv_depth(x)) + 0.1  # (B, bins, h', w')
        depth = torch.einsum("bkhw,k->bhw", p / p.sum(1, keepdim=True), self.depths.to(p.dtype))
        return depth.clamp(self.min_depth, self.max_depth)


class DepthModel(DenseModel):
    """A depth estimator: the backbone's maps of ``indices`` (through its final norm where ``norm``) through
    ``head``; an output of another size than the input (DPT's at 14-pixel patches) is resized to it (bilinear, as
    Meta's DINOv2 depthers do)."""

    task = "depth"  # the task whose commands read its exports (vitkit.task metadata)
    output_names = ("depth",)

    def __init__(self, backbone: nn.Module, head: DPTDepthHead | LinearDepthHead | BinsDepthHead,
                 indices: Sequence[int], norm: bool = True) -> None:
        super().__init__(backbone, indices, norm=norm)
        self.head = head

    @property
    def kind(self) -> str:
        """``relative`` or ``metric``."""
        return self.head.kind

    @property
    def extra_metadata(self) -> dict:
        """What an export records beside the preprocessing (``vitkit.depth``): the kind and a metric model's range."""
        return {"depth": {"kind": self.kind, "max_depth": self.head.max_depth if self.kind == "metric" else None}}

    def _head_maps(self, x: Tensor) -> list:
        if not getattr(self.head, "reads_class_token", False):
            return self._maps(x)
        maps = self.backbone.forward_intermediates(x, indices=self.indices, norm=self.norm, intermediates_only=True,
                                                   return_prefix_tokens=True)
        return [(m, prefix[:, 0]) for m, prefix in maps]  # (B, C, h, w) with the class token (B, C)

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> depth (B, H, W); an input that is not whole patches is padded at the bottom and
        right, and the map cut back."""
        H, W = x.shape[-2:]
        x = self._padded(x)
        depth = self.head(self._head_maps(x), x.shape[-2:])
        if not self.head.at_input_size:  # resized even where it is the input's size: an export holds the resize
            depth = F.interpolate(depth[:, None], size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        return depth[..., :H, :W]


def build_depth_model(backbone: nn.Module, indices: Sequence[int] | None = None, *, channels: int = 256,
                      reassemble: Sequence[int] | None = None, hidden: int = 32, kind: str = "relative",
                      max_depth: float | None = 1.0, head: str = "dpt", norm: bool = True, **head_args
                      ) -> DepthModel:
    """A :class:`DepthModel` with DPT's depth head (``head="dpt"``; ``head_args``: its ``style``, ``readout``,
    ``project``, ``bias``, ``min_depth``), a linear probe (``"linear"``,
    :class:`~vitkit.models.heads.LinearDepthHead`) or DINOv2's binned linear head (``"bins"``: ``bins``,
    ``min_depth``, ``upsample``) on a built plain ViT ``backbone`` (``num_classes=0``); ``indices`` default: four
    layers evenly spread, ending at the last (2, 5, 8, 11 of 12: Depth Anything's and DINOv2's for ViT-S and B)."""
    if head not in HEAD_KINDS:
        raise UsageError(f"a depth model's head is one of {', '.join(HEAD_KINDS)}, got {head!r}")
    if is_hierarchical(backbone):
        raise UsageError(f"DPT's depth head reads a plain ViT's maps of one resolution; "
                         f"{getattr(backbone, 'name', type(backbone).__name__)} gives maps at several")
    indices = layer_indices(backbone, indices, 4)  # DINOv2's "linear" (one layer) head: indices=[-1]
    chs = [backbone.feature_info[i]["num_chs"] for i in indices]
    if head == "linear":
        made = LinearDepthHead(chs, kind, max_depth)
    elif head == "bins":
        made = BinsDepthHead(chs, max_depth=max_depth, **head_args)
    else:
        made = DPTDepthHead(chs, channels, reassemble, hidden, kind, max_depth, **head_args)
    if getattr(made, "reads_class_token", False) and not getattr(backbone, "num_prefix_tokens", 0):
        raise UsageError(f"this depth head reads each layer's class token; "
                         f"{getattr(backbone, 'name', type(backbone).__name__)} has none")
    return DepthModel(backbone, made, indices, norm=norm)
