"""vitkit: ViT and Swin on one attention core, with Lightning training, checkpoint loading and benchmarks."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import moved

__version__ = "0.1.0"

moved.install()  # vitkit.tools.export, vitkit.lora, ...: the modules at their new paths

# Each public name and the module that defines it. They, and the subpackages (vitkit.models, vitkit.lit, ...), are
# imported when first used: `vitkit --help` and `vitkit recipes` answer without loading torch.
_PUBLIC = {"create_mim": "builder", "create_model": "builder", "create_segmenter": "builder", "family": "builder",
           "get_config": "builder", "list_models": "models", "load_checkpoint": "checkpoints",
           "load_depth_estimator": "builder", "load_detector": "builder", "load_segmenter": "builder",
           "read_checkpoint": "checkpoints",
           "save_pretrained": "checkpoints"}
__all__ = ["create_mim", "create_model", "create_segmenter", "family", "get_config", "list_models", "load_checkpoint",
           "load_depth_estimator", "load_detector", "load_segmenter", "read_checkpoint", "save_pretrained"]

if TYPE_CHECKING:
    from .builder import (
        create_mim,
        create_model,
        create_segmenter,
        family,
        get_config,
        load_depth_estimator,
        load_detector,
        load_segmenter,
    )
    from .checkpoints import load_checkpoint, read_checkpoint, save_pretrained
    from .models import list_models


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # the module exists; something it imports does not
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
