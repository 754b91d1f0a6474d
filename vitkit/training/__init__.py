"""What every task's training shares: the Lightning module base (``TrainingModule``: sharding or compiling, the
schedule, the EMA, exact resume), optimisers and schedules, checkpoint callbacks and the CSV logger, a batch fitted to
a small split (``StepsPerEpoch``), the FSDP2 strategy and its sharding. The tasks (``vitkit.tasks``) build on it; it
knows none of them."""

from .base import EMA, TrainingModule
from .callbacks import AtomicCheckpointIO, CSVLogger, ModelCheckpoint, TrainingCurves
from .recipe import Recipe
from .steps import StepsPerEpoch
from .strategies import FSDP2Strategy

__all__ = ["EMA", "AtomicCheckpointIO", "CSVLogger", "FSDP2Strategy", "ModelCheckpoint", "Recipe", "StepsPerEpoch",
           "TrainingCurves", "TrainingModule"]
