"""Image classification: ``ImageClassifier`` (the DeiT/Swin recipe around any preset), one label or several per
image (``multilabel.py``), small labelled sets with the probe fitted first (``small_data.py``, ``probe.py``),
distillation from a teacher (``distill.py``), and ``vitkit train test``'s report (``report.py``). The classifier is
built from typed parts: ``labels.py`` (``SingleLabel``, ``MultiLabel``), ``adaptation.py`` (``Full``, ``Frozen``,
``LoRA``) and ``distill.Teacher``, with the training base's ``Recipe``; ``flat.py`` translates the flat arguments of
before the parts."""

from .adaptation import Frozen, Full, LoRA
from .classifier import ImageClassifier
from .distill import Teacher
from .labels import MultiLabel, SingleLabel
from .small_data import StepsPerEpoch

__all__ = ["Frozen", "Full", "ImageClassifier", "LoRA", "MultiLabel", "SingleLabel", "StepsPerEpoch", "Teacher"]
