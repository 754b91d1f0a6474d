"""Heads for dense tasks on any backbone's maps (``forward_intermediates``, timm's contract): what segmentation, depth
and detection heads are built from, in mmsegmentation's parameter names.

* :class:`LinearHead`: DINOv2's linear protocol (Meta's ``BNHead``): the patch maps of one layer, or of several
  concatenated, a BatchNorm and a 1x1 conv.
* :class:`UperNetHead`: UperNet (Xiao et al., 2018) on a pyramid of maps (Swin's four stages): a pooling pyramid on
  the coarsest, a feature pyramid down to the finest, fused; :class:`FCNHead` is its auxiliary head in training.
* :class:`DPTHead`: DPT (Ranftl et al., 2021) for plain ViTs: four layers' maps reassembled at 1/4 to 1/32 of the
  input, fused from the coarsest, upsampled.

Each ends in ``conv_seg``, a 1x1 conv to ``num_classes`` channels: classes for segmentation, one channel for depth.
The names are mmsegmentation's (``conv_seg``, ``bottleneck.conv``, ``bottleneck.bn``), which Meta's DINOv2 head files
and mmsegmentation checkpoints hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitkit.errors import UsageError

READOUTS = ("ignore", "add", "project")  # what DPT does with a layer's class token


def resize(x: Tensor, size: Sequence[int]) -> Tensor:
    """Bilinear, corners not aligned (mmsegmentation's, transformers' and Meta's ``resize``); a no-op at the size."""
    return x if tuple(x.shape[-2:]) == tuple(size) else F.interpolate(x, size=tuple(size), mode="bilinear",
                                                                       align_corners=False)


class ConvModule(nn.Sequential):
    """Conv (no bias), BatchNorm, ReLU: mmsegmentation's ``ConvModule`` with its children's names."""

    def __init__(self, cin: int, cout: int, kernel: int, padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.activate = nn.ReLU(inplace=True)


class AdaptiveAvgPool(nn.Module):
    """``nn.AdaptiveAvgPool2d(size)`` as two averaging matrices built from the input's size (bin i of n covers
    floor(i n / s) to ceil((i + 1) n / s), PyTorch's bins): the same numbers, and an exported graph that computes
    the bins for each input's size, where ONNX's adaptive pooling keeps the traced size's."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def bins(self, n: int, like: Tensor) -> Tensor:
        """(size, n): row i averages bin i's positions."""
        i = torch.arange(self.size, device=like.device)
        start, end = i * n // self.size, ((i + 1) * n + self.size - 1) // self.size
        j = torch.arange(n, device=like.device)[None]
        inside = ((j >= start[:, None]) & (j < end[:, None])).to(like.dtype)
        return inside / inside.sum(1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        rows, cols = self.bins(x.shape[-2], x), self.bins(x.shape[-1], x)
        return torch.einsum("ih,bchw,jw->bcij", rows, x, cols)


class LinearHead(nn.Module):
    """A BatchNorm and a 1x1 conv on the maps given, resized to the first one's size and concatenated."""

    def __init__(self, in_channels: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.in_channels = list(in_channels)
        self.bn = nn.BatchNorm2d(sum(self.in_channels))
        self.conv_seg = nn.Conv2d(sum(self.in_channels), num_classes, 1)

    def forward(self, maps: Sequence[Tensor]) -> Tensor:
        x = torch.cat([resize(m, maps[0].shape[-2:]) for m in maps], dim=1)
        return self.conv_seg(self.bn(x))


class UperNetHead(nn.Module):
    """UperNet: a pooling pyramid (``pool_scales``) on the coarsest map, lateral 1x1 convs on the others, each level
    adding the coarser one upsampled, every level brought to the finest and fused by a 3x3 conv."""

    def __init__(self, in_channels: Sequence[int], num_classes: int, channels: int = 512,
                 pool_scales: Sequence[int] = (1, 2, 3, 6), dropout: float = 0.1) -> None:
        super().__init__()
        self.in_channels, top = list(in_channels), in_channels[-1]
        self.psp_modules = nn.ModuleList(nn.Sequential(AdaptiveAvgPool(s), ConvModule(top, channels, 1))
                                         for s in pool_scales)
        self.bottleneck = ConvModule(top + len(pool_scales) * channels, channels, 3, padding=1)
        self.lateral_convs = nn.ModuleList(ConvModule(c, channels, 1) for c in in_channels[:-1])
        self.fpn_convs = nn.ModuleList(ConvModule(channels, channels, 3, padding=1) for _ in in_channels[:-1])
        self.fpn_bottleneck = ConvModule(len(in_channels) * channels, channels, 3, padding=1)
        self.dropout = nn.Dropout2d(dropout)
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)

    def forward(self, maps: Sequence[Tensor]) -> Tensor:
        top = maps[-1]
        pooled = [resize(p(top), top.shape[-2:]) for p in self.psp_modules]
        levels = [conv(m) for conv, m in zip(self.lateral_convs, maps, strict=False)]
        levels.append(self.bottleneck(torch.cat([top, *pooled], dim=1)))
        for i in range(len(levels) - 1, 0, -1):  # top-down: each level takes the coarser one
            levels[i - 1] = levels[i - 1] + resize(levels[i], levels[i - 1].shape[-2:])
        outs = [conv(level) for conv, level in zip(self.fpn_convs, levels, strict=False)] + [levels[-1]]
        fused = self.fpn_bottleneck(torch.cat([resize(o, outs[0].shape[-2:]) for o in outs], dim=1))
        return self.conv_seg(self.dropout(fused))


class FCNHead(nn.Module):
    """The auxiliary head of UperNet's training: ``num_convs`` 3x3 convs on one map, then a 1x1 conv to classes."""

    def __init__(self, in_channels: int, num_classes: int, channels: int = 256, num_convs: int = 1,
                 concat_input: bool = False, dropout: float = 0.1) -> None:
        super().__init__()
        self.convs = nn.Sequential(*(ConvModule(in_channels if i == 0 else channels, channels, 3, padding=1)
                                     for i in range(num_convs)))
        self.conv_cat = ConvModule(in_channels + channels, channels, 3, padding=1) if concat_input else None
        self.dropout = nn.Dropout2d(dropout)
        self.conv_seg = nn.Conv2d(channels if num_convs else in_channels, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        out = self.convs(x)
        if self.conv_cat is not None:
            out = self.conv_cat(torch.cat([x, out], dim=1))
        return self.conv_seg(self.dropout(out))


class _ResidualConvUnit(nn.Module):
    def __init__(self, channels: int, bias: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=bias)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class _Fusion(nn.Module):
    """DPT's fusion block: this level's map (through a residual unit, resized to the path's size where they differ)
    added to the coarser path, a residual unit, upsampled (to the next finer level's size, or 2x), a 1x1 conv:
    Depth Anything's and transformers' ``FeatureFusionLayer``, DINOv2's ``FeatureFusionBlock``."""

    def __init__(self, channels: int, bias: bool = True, double: bool = False) -> None:
        super().__init__()
        self.double = double
        self.skip = _ResidualConvUnit(channels, bias)
        self.refine = _ResidualConvUnit(channels, bias)
        self.project = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor, level: Tensor | None = None, size: Sequence[int] | None = None) -> Tensor:
        if level is not None:  # doubling, the path outgrows an odd level: always resized (a no-op at its size),
            # so that an exported graph holds the resize for every input size
            level = F.interpolate(level, size=x.shape[-2:], mode="bilinear", align_corners=False) if self.double \
                else resize(level, x.shape[-2:])
            x = x + self.skip(level)
        x = self.refine(x)
        to = {"scale_factor": 2} if size is None or self.double else {"size": tuple(size)}
        return self.project(F.interpolate(x, **to, mode="bilinear", align_corners=True))


class DPTNeck(nn.Module):
    """DPT's reassembly and fusion on four maps of one plain ViT's resolution (1/patch): each projected (1x1) to its
    width of ``reassemble`` and resampled to 4x, 2x, 1x and 1/2x of it, brought to ``channels`` (3x3), then fused
    from the coarsest to the finest; :meth:`fuse` gives the finest fused map. A head subclass adds what reads it.

    ``readout``: what the class token of each layer does before the projection: ``ignore`` (Depth Anything's),
    ``add`` (added to every patch) or ``project`` (concatenated to every patch, a linear map back and GELU: DPT's
    and DINOv2's depth heads). ``double``: each fusion upsamples 2x (DPT's, transformers' ``DPTForDepthEstimation``
    and DINOv2's) instead of to the next level's size (Depth Anything's); they differ where the patch grid is odd.
    ``bias``: the fusions' residual convs have biases (DINOv2's have none)."""

    def __init__(self, in_channels: Sequence[int], channels: int = 256, reassemble: Sequence[int] | None = None,
                 readout: str = "ignore", double: bool = False, bias: bool = True) -> None:
        super().__init__()
        if len(in_channels) != 4:
            raise UsageError(f"{type(self).__name__} takes the maps of 4 layers, got {len(in_channels)}")
        if readout not in READOUTS:
            raise UsageError(f"DPT's readout is one of {', '.join(READOUTS)}, got {readout!r}")
        dim = in_channels[-1]
        widths = list(reassemble or (dim // 8, dim // 4, dim // 2, dim))
        self.in_channels, self.readout, self.double = list(in_channels), readout, double
        self.readouts = nn.ModuleList(nn.Sequential(nn.Linear(2 * c, c), nn.GELU()) for c in in_channels) \
            if readout == "project" else None
        self.projects = nn.ModuleList(nn.Conv2d(c, w, 1) for c, w in zip(in_channels, widths, strict=True))
        self.resamples = nn.ModuleList([nn.ConvTranspose2d(widths[0], widths[0], 4, stride=4),
                                        nn.ConvTranspose2d(widths[1], widths[1], 2, stride=2), nn.Identity(),
                                        nn.Conv2d(widths[3], widths[3], 3, stride=2, padding=1)])
        self.levels = nn.ModuleList(nn.Conv2d(w, channels, 3, padding=1, bias=False) for w in widths)
        self.fusions = nn.ModuleList(_Fusion(channels, bias, double) for _ in widths)
        # the coarsest fusion has no finer level to take: its skip unit never runs (kept for the files' keys), out of
        # the optimizer and of DDP's gradient reduction, which stops on a parameter that gets no gradient
        self.fusions[3].skip.requires_grad_(False)

    @property
    def reads_class_token(self) -> bool:
        """Whether the maps come paired with their layer's class token (B, C)."""
        return self.readout != "ignore"

    def _read_out(self, i: int, m: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        if self.readout == "ignore":
            return m
        m, token = m
        B, C, h, w = m.shape
        if self.readout == "add":
            return m + token[:, :, None, None]
        x = m.flatten(2).transpose(1, 2)  # (B, h*w, C)
        x = self.readouts[i](torch.cat([x, token[:, None].expand_as(x)], dim=-1))
        return x.transpose(1, 2).reshape(B, C, h, w)

    def fuse(self, maps: Sequence[Tensor] | Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        levels = [lv(rs(pr(self._read_out(i, m)))) for i, (m, pr, rs, lv) in
                  enumerate(zip(maps, self.projects, self.resamples, self.levels, strict=True))]
        x = self.fusions[3](levels[3], size=levels[2].shape[-2:])
        for i in (2, 1, 0):
            x = self.fusions[i](x, levels[i], size=levels[i - 1].shape[-2:] if i else None)
        return x


class DPTHead(DPTNeck):
    """DPT for segmentation: the neck's finest map through a conv block and a 1x1 conv to classes."""

    def __init__(self, in_channels: Sequence[int], num_classes: int, channels: int = 256,
                 reassemble: Sequence[int] | None = None, dropout: float = 0.1) -> None:
        super().__init__(in_channels, channels, reassemble)
        self.head = nn.Sequential(ConvModule(channels, channels, 3, padding=1), nn.Dropout2d(dropout))
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)

    def forward(self, maps: Sequence[Tensor]) -> Tensor:
        return self.conv_seg(self.head(self.fuse(maps)))


class DPTDepthHead(DPTNeck):
    """DPT for depth (Ranftl et al., 2021): the neck's finest map through a 3x3 conv to half its channels, upsampled,
    a 3x3 conv to ``hidden``, ReLU, a 1x1 conv to one channel. The names are transformers' ``head.conv1``/``conv2``/
    ``conv3``; ``style`` is whose head it is:

    * ``depth_anything``: upsampled to ``size`` (the input's patch grid times the patch), then ReLU (relative depth:
      affine-invariant inverse depth) or a sigmoid (metric depth, in the units of ``max_depth``), times
      ``max_depth`` (1 for a relative model as a rule).
    * ``dpt`` (transformers' ``DPTForDepthEstimation``, DINOv2's DPT depth heads): the neck's fusions double, an
      optional 3x3 conv and ReLU first (``project``), upsampled 2x (the input's size at 16-pixel patches; the model
      resizes other outputs to the input), then ReLU, plus ``min_depth``, clamped to ``max_depth`` for a metric
      model (DINOv2's NYU heads: 0.001 to 10 m).
    """

    def __init__(self, in_channels: Sequence[int], channels: int = 256, reassemble: Sequence[int] | None = None,
                 hidden: int = 32, kind: str = "relative", max_depth: float | None = 1.0, *,
                 style: str = "depth_anything", readout: str = "ignore", project: bool = False, bias: bool = True,
                 min_depth: float = 0.0) -> None:
        if style not in ("depth_anything", "dpt"):
            raise UsageError(f"a DPT depth head's style is depth_anything or dpt, got {style!r}")
        super().__init__(in_channels, channels, reassemble, readout, double=style == "dpt", bias=bias)
        if kind not in ("relative", "metric"):
            raise UsageError(f"a depth head's kind is relative or metric, got {kind!r}")
        self.kind, self.style, self.min_depth = kind, style, float(min_depth)
        self.at_input_size = style == "depth_anything"  # DPT's doubles: the model resizes it to the input
        self.max_depth = None if max_depth is None else float(max_depth)
        if style == "depth_anything" and self.max_depth is None:
            raise UsageError("Depth Anything's head scales its output by max_depth; got None")
        self.project = nn.Conv2d(channels, channels, 3, padding=1) if project else None
        self.conv1 = nn.Conv2d(channels, channels // 2, 3, padding=1)
        self.conv2 = nn.Conv2d(channels // 2, hidden, 3, padding=1)
        self.conv3 = nn.Conv2d(hidden, 1, 1)
        if kind == "relative":  # outputs above 0 at the start: a ReLU that is 0 everywhere would pass no gradient
            nn.init.constant_(self.conv3.bias, 1.0)

    def forward(self, maps: Sequence[Tensor], size: Sequence[int]) -> Tensor:
        x = self.fuse(maps)
        if self.project is not None:
            x = F.relu(self.project(x))
        to = {"scale_factor": 2} if self.style == "dpt" else {"size": tuple(size)}
        x = F.interpolate(self.conv1(x), **to, mode="bilinear", align_corners=True)
        x = self.conv3(F.relu(self.conv2(x)))[:, 0]
        if self.style == "dpt":
            x = F.relu(x) + self.min_depth
            return x.clamp(max=self.max_depth) if self.kind == "metric" and self.max_depth else x
        return (F.relu(x) if self.kind == "relative" else torch.sigmoid(x)) * self.max_depth


class LinearDepthHead(nn.Module):
    """A linear depth probe (DINOv2's "linear4" depth head, without its depth bins): the layers' maps concatenated,
    upsampled 4x, BatchNorm, a 1x1 conv to one channel, upsampled to ``size``, then softplus (relative depth: positive
    inverse depth, and no pixel stops learning as under a ReLU) or a sigmoid times ``max_depth`` (metric depth): one
    linear map of the frozen features per pixel."""

    at_input_size = True

    def __init__(self, in_channels: Sequence[int], kind: str = "relative", max_depth: float = 1.0) -> None:
        super().__init__()
        if kind not in ("relative", "metric"):
            raise UsageError(f"a depth head's kind is relative or metric, got {kind!r}")
        self.kind, self.max_depth = kind, float(max_depth)
        self.norm = nn.BatchNorm2d(sum(in_channels))
        self.conv = nn.Conv2d(sum(in_channels), 1, 1)

    def forward(self, maps: Sequence[Tensor], size: Sequence[int]) -> Tensor:
        x = torch.cat([F.interpolate(m, size=maps[0].shape[-2:], mode="bilinear", align_corners=False)
                       for m in maps], dim=1)
        x = F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=False)
        x = F.interpolate(self.conv(self.norm(x)), size=tuple(size), mode="bilinear", align_corners=False)
        x = F.softplus(x) if self.kind == "relative" else torch.sigmoid(x) * self.max_depth
        return x[:, 0]


HEADS = {"linear": LinearHead, "upernet": UperNetHead, "dpt": DPTHead}
