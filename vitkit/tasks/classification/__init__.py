"""Image classification: ``ImageClassifier`` (the DeiT/Swin recipe around any preset), one label or several per
image (``multilabel.py``), small labelled sets with the probe fitted first (``small_data.py``, ``probe.py``),
distillation from a teacher (``distill.py``), and ``vitkit train test``'s report (``report.py``)."""

from .classifier import ImageClassifier
from .small_data import StepsPerEpoch

__all__ = ["ImageClassifier", "StepsPerEpoch"]
