"""Semantic segmentation: ``Segmenter``, a head (``vitkit.models.segmentation``) on any backbone, trained with
cross-entropy over the pixels that count, validated by mIoU."""

from .segmenter import Segmenter

__all__ = ["Segmenter"]
