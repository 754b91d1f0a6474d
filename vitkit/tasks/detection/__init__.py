"""Object detection: ``Detector``, YOLOS on any vitkit ViT, trained with DETR's set loss (Hungarian matching of
predictions to objects, class and box terms), validated by COCO's AP; ``task.py`` declares it to the commands."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .detector import Detector as Detector
    from .loss import SetLoss as SetLoss

__all__, __getattr__ = lazy_names(__name__, {"Detector": ".detector", "SetLoss": ".loss"})
