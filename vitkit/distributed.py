"""What every rank holds, gathered in rank order: the one collective that checkpoints (data positions, random
streams) and evaluation reports (predictions) share."""

from __future__ import annotations

from typing import Any

import torch


def gather_from_ranks(trainer: Any, obj: Any) -> list:
    """Every rank's ``obj``, in rank order, under a Lightning ``trainer`` (a collective: every rank calls it, e.g. while
    saving)."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [obj]
    objs = [None] * trainer.world_size
    torch.distributed.all_gather_object(objs, obj)
    return objs
