"""Model families (plain PyTorch, no Lightning): ViT/DeiT, Swin, the Transformer encoder-decoder."""

from .config import DataConfig
from .registry import create_model, get_config, list_models
from .swin import SWIN_PRESETS, SwinConfig, SwinTransformer
from .vit import VIT_PRESETS, VisionTransformer, ViTConfig

__all__ = ["DataConfig", "SWIN_PRESETS", "SwinConfig", "SwinTransformer", "VIT_PRESETS", "ViTConfig",
           "VisionTransformer", "create_model", "get_config", "list_models"]
