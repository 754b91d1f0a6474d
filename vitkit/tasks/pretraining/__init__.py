"""Pre-training without labels: MAE and SimMIM (``mim.py``), DINO self-distillation (``dino.py``)."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .dino import DINOPretraining as DINOPretraining
    from .mim import MaskedImageModeling as MaskedImageModeling

__all__, __getattr__ = lazy_names(__name__, {"DINOPretraining": ".dino", "MaskedImageModeling": ".mim"})
