"""Model families and their presets: ``create_model(name, **overrides)`` and ``list_models()``."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from torch import nn

from .swin import SWIN_PRESETS, SwinConfig, SwinTransformer
from .vit import VIT_PRESETS, VisionTransformer, ViTConfig

# family -> (config class, model class, presets keyed by timm's names)
FAMILIES: dict[str, tuple[type, type[nn.Module], dict[str, dict]]] = {
    "vit": (ViTConfig, VisionTransformer, VIT_PRESETS),
    "swin": (SwinConfig, SwinTransformer, SWIN_PRESETS),
}


def _find(name: str) -> tuple[type, type[nn.Module], dict]:
    for cfg_cls, model_cls, presets in FAMILIES.values():
        if name in presets:
            return cfg_cls, model_cls, presets[name]
    close = fnmatch.filter(list_models(), f"*{name.split('_')[0]}*")[:8]
    raise ValueError(f"unknown model {name!r}; vitkit.list_models() lists all {len(list_models())}"
                     + (f" (similar: {', '.join(close)})" if close else ""))


def get_config(name: str, **overrides: Any):
    """The config of preset ``name`` with any of its fields overridden by keyword."""
    cfg_cls, _, preset = _find(name)
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"{name}: unknown config field(s) {unknown}; {cfg_cls.__name__} has {sorted(fields)}")
    return cfg_cls(**{**preset, **overrides})


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (timm's naming), e.g. ``create_model("vit_small_patch16_224", num_classes=10)``."""
    _, model_cls, _ = _find(name)
    model = model_cls(get_config(name, **overrides))
    model.name = name
    return model


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a glob pattern, sorted."""
    names = [n for _, _, presets in FAMILIES.values() for n in presets]
    return sorted(fnmatch.filter(names, pattern))

