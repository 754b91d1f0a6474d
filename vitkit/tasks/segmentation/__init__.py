"""Semantic segmentation: ``Segmenter``, a head (``vitkit.models.heads``) on any backbone, trained with cross-entropy
over the pixels that count, validated by mIoU; ``task.py`` declares it to the commands."""

from vitkit.tasks.protocol import lazy_names

__all__, __getattr__ = lazy_names(__name__, {"Segmenter": ".segmenter"})
