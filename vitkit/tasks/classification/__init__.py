"""Image classification: ``ImageClassifier`` (the DeiT/Swin recipe around any preset), one label or several per
image (``multilabel.py``), small labelled sets with the probe fitted first (``small_data.py``, ``probe.py``),
distillation from a teacher (``distill.py``), and ``vitkit train test``'s report (``report.py``). The classifier is
built from typed parts: ``labels.py`` (``SingleLabel``, ``MultiLabel``), ``adaptation.py`` (``Full``, ``Frozen``,
``LoRA``) and ``distill.Teacher``, with the training base's ``Recipe``; ``flat.py`` translates the flat arguments of
before the parts. ``task.py`` declares the task to the commands."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .adaptation import Frozen as Frozen
    from .adaptation import Full as Full
    from .adaptation import LoRA as LoRA
    from .classifier import ImageClassifier as ImageClassifier
    from .distill import Teacher as Teacher
    from .labels import MultiLabel as MultiLabel
    from .labels import SingleLabel as SingleLabel

__all__, __getattr__ = lazy_names(__name__, {
    "Frozen": ".adaptation", "Full": ".adaptation", "LoRA": ".adaptation", "ImageClassifier": ".classifier",
    "Teacher": ".distill", "MultiLabel": ".labels", "SingleLabel": ".labels"})
