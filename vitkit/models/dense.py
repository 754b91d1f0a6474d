"""What every dense-prediction model shares (segmentation, depth, detection): a backbone's maps by layer
(``forward_intermediates``, timm's contract), each through its LayerNorm where the backbone is hierarchical (Swin's
per-stage norms, as transformers' ``SwinBackbone`` and mmsegmentation's Swin have them) or through the backbone's final
norm (a plain ViT, as DINOv2's heads read it), at any input size: a plain ViT's positions are resampled to the input's
patch grid and its input padded to whole patches, a Swin pads its maps to whole windows. A task's model adds its head
(``vitkit.models.heads``) and says what the head's output means."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.nn import functional as F

from vitkit.errors import UsageError


class OnBackbone:
    """What a task's model on a ``backbone`` answers for the optimiser: the backbone's layer groups and its names
    without weight decay, under ``backbone.`` (the model's own parameters rank with the last layer)."""

    def group_matcher(self, coarse: bool = False) -> dict:
        """The backbone's layer groups (timm's ``group_matcher``) under ``backbone.``: layer-wise LR decay ranks the
        backbone's layers as it would alone, and the heads with the last."""
        def under(pattern: str) -> str:
            return r"^backbone\.(?:" + pattern.removeprefix("^") + ")"

        return {k: [(under(p), s) for p, s in spec] if isinstance(spec, (list, tuple)) else under(spec)
                for k, spec in self.backbone.group_matcher(coarse).items()}

    def no_weight_decay(self) -> set[str]:
        """The backbone's names without weight decay (positions, tokens, relative-position tables)."""
        return {f"backbone.{n}" for n in getattr(self.backbone, "no_weight_decay", set)()}


class DenseModel(OnBackbone, nn.Module):
    """A backbone and the maps a head reads: ``indices`` of its ``feature_info``, each through its LayerNorm where
    ``stage_norms``, or through the backbone's final norm where ``norm``. Its parameters are named ``backbone.*``
    and ``stage_norms.*``; a subclass adds its head."""

    def __init__(self, backbone: nn.Module, indices: Sequence[int], *, stage_norms: bool = False, norm: bool = False,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.backbone, self.indices, self.norm = backbone, list(indices), norm
        chs = [backbone.feature_info[i]["num_chs"] for i in self.indices]
        self.stage_norms = nn.ModuleList(nn.LayerNorm(c, eps=eps) for c in chs) if stage_norms else None
        if hasattr(backbone, "set_dynamic_img_size"):  # a ViT at any size, its positions resampled (Swin pads)
            backbone.set_dynamic_img_size(True)

    @property
    def channels(self) -> list[int]:
        """The channels of each map a head reads."""
        return [self.backbone.feature_info[i]["num_chs"] for i in self.indices]

    @property
    def cfg(self):
        """The backbone's config: the input size, mean and std the model takes."""
        return self.backbone.cfg

    @property
    def name(self) -> str:
        """The backbone's preset, or the name the model was given (a loaded folder's)."""
        return self.__dict__.get("_name") or self.backbone.name

    @name.setter
    def name(self, value: str) -> None:
        self.__dict__["_name"] = value

    def set_attn_backend(self, backend: str) -> None:
        self.backbone.set_attn_backend(backend)

    def set_dynamic_img_size(self, enable: bool = True) -> None:
        """A ViT backbone at any multiple of its patch (positions resampled): the segmenter at any size."""
        self.backbone.set_dynamic_img_size(enable)

    def features(self, x: Tensor) -> list[Tensor]:
        """The maps the heads read, (B, C, h, w) each."""
        return self._maps(x)

    def _maps(self, x: Tensor) -> list[Tensor]:
        if self.stage_norms is None:
            return self.backbone.forward_intermediates(x, indices=self.indices, norm=self.norm,
                                                       intermediates_only=True)
        maps = self.backbone.forward_intermediates(x, indices=self.indices, output_fmt="NHWC",
                                                   intermediates_only=True)
        return [n(m).permute(0, 3, 1, 2).contiguous() for n, m in zip(self.stage_norms, maps, strict=True)]

    def _padded(self, x: Tensor) -> Tensor:
        """A plain ViT's input zero-padded at the bottom and right to whole patches (as DINOv2's and mmsegmentation's
        segmenters pad it); the logits are cut back to the input's size. Swin pads its own maps."""
        p = self.patch_multiple
        H, W = x.shape[-2:]
        if p == 1 or (H % p == 0 and W % p == 0):
            return x
        return F.pad(x, (0, -W % p, 0, -H % p))

    @property
    def patch_multiple(self) -> int:
        """The multiple a plain ViT backbone's input is padded to (its patch), 1 for a backbone that pads itself."""
        return self.backbone.patch_size if getattr(self.backbone, "dynamic_img_size", False) else 1


def is_hierarchical(backbone: nn.Module) -> bool:
    """Whether the backbone's maps come at several reductions (Swin's stages), not one (a plain ViT's blocks)."""
    return len({f["reduction"] for f in backbone.feature_info}) > 1


def layer_indices(backbone: nn.Module, indices: Sequence[int] | None, count: int) -> list[int]:
    """The layers a head reads: ``indices`` checked (``-1``: the last), or by default every stage of a hierarchical
    backbone, and ``count`` layers of a plain ViT evenly spread, ending at the last (4 of 12 blocks: 2, 5, 8, 11,
    DPT's; 1: the last)."""
    n = len(backbone.feature_info)
    if indices is None:
        spread = [(k + 1) * n // count - 1 for k in range(count)]
        indices = list(range(n)) if is_hierarchical(backbone) or n < count else spread
    wrong = [i for i in indices if not -n <= i < n]
    if wrong:
        raise UsageError(f"indices {wrong} are not layers of {getattr(backbone, 'name', 'the backbone')}, which has "
                         f"{n} (0 to {n - 1}, or -1 for the last)")
    indices = [i % n for i in indices]
    if any(a >= b for a, b in zip(indices, indices[1:], strict=False)):
        raise UsageError(f"indices must name distinct layers in increasing order (the backbone gives its maps in "
                         f"that order), got {indices}")
    return indices
