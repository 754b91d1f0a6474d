"""Depth from one image: ``DepthEstimator``, DPT's depth head on any plain vitkit ViT, relative or metric, trained with
MiDaS's scale-and-shift-invariant loss or the scale-invariant log loss, scored by Eigen's errors; ``task.py``
declares it to the commands."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .estimator import DepthEstimator as DepthEstimator
    from .estimator import DepthLoss as DepthLoss

__all__, __getattr__ = lazy_names(__name__, {"DepthEstimator": ".estimator", "DepthLoss": ".estimator"})
