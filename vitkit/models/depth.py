"""Depth from one image on any plain vitkit ViT: :class:`DepthModel` runs four layers' maps (``forward_intermediates``
through the backbone's final norm, as DINOv2's and Depth Anything's heads read them) through DPT's depth head
(``vitkit.models.heads.DPTDepthHead``) to a depth map (B, H, W) at the input's size: relative (affine-invariant
inverse depth, MiDaS's and Depth Anything's) or metric (metres up to ``max_depth``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from vitkit.errors import UsageError

from .dense import DenseModel, is_hierarchical, layer_indices
from .heads import DPTDepthHead, LinearDepthHead


class DepthModel(DenseModel):
    """A depth estimator: the backbone's maps of ``indices`` through ``head`` (a :class:`DPTDepthHead`)."""

    task = "depth"  # the task whose commands read its exports (vitkit.task metadata)
    output_names = ("depth",)

    def __init__(self, backbone: nn.Module, head: DPTDepthHead | LinearDepthHead, indices: Sequence[int]) -> None:
        super().__init__(backbone, indices, norm=True)
        self.head = head

    @property
    def kind(self) -> str:
        """``relative`` or ``metric``."""
        return self.head.kind

    @property
    def extra_metadata(self) -> dict:
        """What an export records beside the preprocessing (``vitkit.depth``): the kind and a metric model's range."""
        return {"depth": {"kind": self.kind, "max_depth": self.head.max_depth if self.kind == "metric" else None}}

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> depth (B, H, W); an input that is not whole patches is padded at the bottom and
        right, and the map cut back."""
        H, W = x.shape[-2:]
        x = self._padded(x)
        return self.head(self._maps(x), x.shape[-2:])[..., :H, :W]


def build_depth_model(backbone: nn.Module, indices: Sequence[int] | None = None, *, channels: int = 256,
                      reassemble: Sequence[int] | None = None, hidden: int = 32, kind: str = "relative",
                      max_depth: float = 1.0, head: str = "dpt") -> DepthModel:
    """A :class:`DepthModel` with DPT's depth head (``head="dpt"``) or a linear probe (``"linear"``,
    :class:`~vitkit.models.heads.LinearDepthHead`) on a built plain ViT ``backbone`` (``num_classes=0``); ``indices``
    default: four layers evenly spread, ending at the last (2, 5, 8, 11 of 12: Depth Anything's for ViT-S and B)."""
    if head not in ("dpt", "linear"):
        raise UsageError(f"a depth model's head is dpt or linear, got {head!r}")
    if is_hierarchical(backbone):
        raise UsageError(f"DPT's depth head reads a plain ViT's maps of one resolution; "
                         f"{getattr(backbone, 'name', type(backbone).__name__)} gives maps at several")
    indices = layer_indices(backbone, indices, 4)
    chs = [backbone.feature_info[i]["num_chs"] for i in indices]
    if head == "linear":
        return DepthModel(backbone, LinearDepthHead(chs, kind, max_depth), indices)
    return DepthModel(backbone, DPTDepthHead(chs, channels, reassemble, hidden, kind, max_depth), indices)
