"""The image encoders other models are built on (image-to-text, masked image modeling): a ViT or Swin preset
without its classifier, built from the preset table."""

from __future__ import annotations

from typing import Any

from torch import nn

from vitkit.errors import UsageError

from .swin import SwinConfig, SwinTransformer
from .swin_presets import SWIN_PRESETS
from .vit import VisionTransformer, ViTConfig
from .vit_presets import VIT_PRESETS


def vision_encoder(name: str, **overrides: Any) -> nn.Module:
    """A ViT or Swin preset without its classifier (``num_classes=0``), named as the preset."""
    for presets, cfg_cls, model_cls in ((VIT_PRESETS, ViTConfig, VisionTransformer),
                                        (SWIN_PRESETS, SwinConfig, SwinTransformer)):
        if name in presets:
            net = model_cls(cfg_cls(**{**presets[name], **overrides, "num_classes": 0}))
            net.name = name
            return net
    raise UsageError(f"vision_encoder {name!r} is not a ViT or Swin preset (vitkit.list_models('vit*'), "
                     "vitkit.list_models('swin*'))")
