"""Segmentation on any vitkit backbone: :class:`SegmentationModel` runs a backbone's maps by layer
(``forward_intermediates``, timm's contract) through a head of ``vitkit.models.heads`` (linear, UperNet, DPT) to class
logits at the input's size; :func:`build_segmenter` puts one together. ``vitkit/checkpoints/segmentation.py`` maps
transformers' ``UperNetForSemanticSegmentation`` and mmsegmentation's files onto these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from vitkit.errors import UsageError

from .dense import DenseModel, is_hierarchical, layer_indices
from .heads import HEADS, AdaptiveAvgPool, ConvModule, DPTHead, FCNHead, LinearHead, UperNetHead, resize

__all__ = ["HEADS", "AdaptiveAvgPool", "ConvModule", "DPTHead", "FCNHead", "LinearHead", "SegmentationModel",
           "UperNetHead", "build_segmenter", "resize"]


@dataclass
class SegmentationOutput:
    """What a segmenter's training forward gives (as transformers' ``SemanticSegmenterOutput``): the logits (B, K,
    H, W), the auxiliary head's (or None), and the loss where the task has computed it."""

    logits: Tensor
    aux_logits: Tensor | None = None
    loss: Tensor | None = None


class SegmentationModel(DenseModel):
    """A segmenter: the maps of :class:`~vitkit.models.dense.DenseModel` through ``decode_head`` to logits (B,
    classes, H, W) at the input's size, whatever its size. ``auxiliary_head`` (training only) reads map
    ``aux_index``."""

    def __init__(self, backbone: nn.Module, decode_head: nn.Module, indices: Sequence[int], *,
                 auxiliary_head: nn.Module | None = None, aux_index: int = 2, stage_norms: bool = False,
                 norm: bool = False, eps: float = 1e-5) -> None:
        super().__init__(backbone, indices, stage_norms=stage_norms, norm=norm, eps=eps)
        self.decode_head, self.auxiliary_head, self.aux_index = decode_head, auxiliary_head, aux_index

    @property
    def num_classes(self) -> int:
        return self.decode_head.conv_seg.out_channels

    forward_methods = ("forward_train", "features")  # entry points besides forward (FSDP2 wraps each: sharding.py)
    task = "segmentation"  # the task whose commands read its exports (vitkit.task metadata)

    def forward(self, x: Tensor) -> Tensor:
        H, W = x.shape[-2:]
        x = self._padded(x)
        return resize(self.decode_head(self._maps(x)), x.shape[-2:])[..., :H, :W]

    def forward_train(self, x: Tensor) -> SegmentationOutput:
        """The logits and the auxiliary head's (or None), both at the input's size."""
        H, W = x.shape[-2:]
        x = self._padded(x)
        maps = self._maps(x)
        aux = self.auxiliary_head(maps[self.aux_index]) if self.auxiliary_head is not None else None
        return SegmentationOutput(resize(self.decode_head(maps), x.shape[-2:])[..., :H, :W],
                                  None if aux is None else resize(aux, x.shape[-2:])[..., :H, :W])


def build_segmenter(backbone: nn.Module, head: str, num_classes: int, indices: Sequence[int] | None = None,
                    *, auxiliary: bool | None = None, aux_args: dict | None = None, **head_args) -> SegmentationModel:
    """A :class:`SegmentationModel` with ``head`` ("linear", "upernet" or "dpt") on a built ``backbone``.

    ``indices`` default: every stage for a hierarchical backbone (Swin: 4 maps); for a plain ViT the last layer
    (linear), or four layers evenly spread, ending at the last (DPT, UperNet). UperNet on Swin takes the per-stage
    norms and the auxiliary FCN head (``aux_args``: :class:`FCNHead`'s) on the third map unless ``auxiliary`` is
    False; ``head_args`` go to the head."""
    if head not in HEADS:
        raise UsageError(f"head must be one of {sorted(HEADS)}, got {head!r}")
    hierarchical = is_hierarchical(backbone)
    indices = layer_indices(backbone, indices, 1 if head == "linear" else 4)
    chs = [backbone.feature_info[i]["num_chs"] for i in indices]
    decode = HEADS[head](chs, num_classes, **head_args)
    aux = None
    if head == "upernet" and (auxiliary if auxiliary is not None else hierarchical):
        aux = FCNHead(chs[min(2, len(chs) - 1)], num_classes, **(aux_args or {}))
    return SegmentationModel(backbone, decode, indices, auxiliary_head=aux, aux_index=min(2, len(chs) - 1),
                             stage_norms=hierarchical and head == "upernet", norm=not hierarchical)
