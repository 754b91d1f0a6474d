"""Pre-training without labels: MAE and SimMIM (``mim.py``), DINO self-distillation (``dino.py``)."""

from .dino import DINOPretraining
from .mim import MaskedImageModeling

__all__ = ["DINOPretraining", "MaskedImageModeling"]
