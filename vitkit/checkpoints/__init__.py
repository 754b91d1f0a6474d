"""Checkpoints from local files: formats, key maps, resampling, safe loading, export.

``files`` reads and writes without ever unpickling code, ``formats`` holds every key remapping,
``adapt`` fits weights to a new resolution / window / channels / head, ``load`` ties them together.
"""

from .adapt import adapt_input_conv, resize_rel_pos_table
from .files import CheckpointError, UnsafeCheckpointError
from .formats import FORMATS
from .load import Checkpoint, CheckpointMismatchError, LoadReport, load_checkpoint, read_checkpoint, save_pretrained

__all__ = ["FORMATS", "Checkpoint", "CheckpointError", "CheckpointMismatchError", "LoadReport",
           "UnsafeCheckpointError", "adapt_input_conv", "load_checkpoint", "read_checkpoint",
           "resize_rel_pos_table", "save_pretrained"]
