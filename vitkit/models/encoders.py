"""The image encoders other models are built on (image-to-text, masked image modeling): an image family's preset
without its classifier, built from the preset table."""

from __future__ import annotations

from typing import Any

from torch import nn

from vitkit.errors import UsageError

from .families import FAMILIES


def vision_encoder(name: str, **overrides: Any) -> nn.Module:
    """An image family's preset without its classifier (``num_classes=0``), named as the preset."""
    for family in FAMILIES.values():
        if family.images and name in family.presets:
            net = family.model(family.config(**{**family.presets[name], **overrides, "num_classes": 0}))
            net.name = name
            return net
    images = ", ".join(f"vitkit.list_models('{fam}*')" for fam, f in FAMILIES.items() if f.images)
    raise UsageError(f"vision_encoder {name!r} is not an image encoder's preset ({images})")
