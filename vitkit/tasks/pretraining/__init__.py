"""Pre-training without labels: MAE and SimMIM (``mim.py``), DINO self-distillation (``dino.py``)."""

from vitkit.tasks.protocol import lazy_names

__all__, __getattr__ = lazy_names(__name__, {"DINOPretraining": ".dino", "MaskedImageModeling": ".mim"})
