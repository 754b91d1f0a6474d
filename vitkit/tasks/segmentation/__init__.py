"""Semantic segmentation: ``Segmenter``, a head (``vitkit.models.heads``) on any backbone, trained with cross-entropy
over the pixels that count, validated by mIoU; ``task.py`` declares it to the commands."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .segmenter import Segmenter as Segmenter

__all__, __getattr__ = lazy_names(__name__, {"Segmenter": ".segmenter"})
