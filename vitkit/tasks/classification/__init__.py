"""Image classification: ``ImageClassifier`` (the DeiT/Swin recipe around any preset), one label or several per
image (``multilabel.py``), small labelled sets with the probe fitted first (``small_data.py``, ``probe.py``),
distillation from a teacher (``distill.py``), and ``vitkit train test``'s report (``report.py``). The classifier is
built from typed parts: ``labels.py`` (``SingleLabel``, ``MultiLabel``), ``adaptation.py`` (``Full``, ``Frozen``,
``LoRA``) and ``distill.Teacher``, with the training base's ``Recipe``; ``flat.py`` translates the flat arguments of
before the parts. ``task.py`` declares the task to the commands."""

from vitkit.tasks.protocol import lazy_names

__all__, __getattr__ = lazy_names(__name__, {
    "Frozen": ".adaptation", "Full": ".adaptation", "LoRA": ".adaptation", "ImageClassifier": ".classifier",
    "Teacher": ".distill", "MultiLabel": ".labels", "SingleLabel": ".labels", "StepsPerEpoch": ".small_data"})
