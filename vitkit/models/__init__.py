"""Model families (plain PyTorch, no Lightning): ViT/DeiT, Swin, the Transformer encoder-decoder."""

from .config import DataConfig
from .registry import FAMILIES, find, list_models, preset_config
from .seq2seq import SEQ2SEQ_PRESETS, Seq2SeqConfig, Seq2SeqTransformer
from .swin import SwinConfig, SwinTransformer
from .swin_presets import SWIN_PRESETS
from .vit import VisionTransformer, ViTConfig
from .vit_presets import VIT_PRESETS

__all__ = ["DataConfig", "SEQ2SEQ_PRESETS", "SWIN_PRESETS", "Seq2SeqConfig", "Seq2SeqTransformer", "SwinConfig",
           "SwinTransformer", "VIT_PRESETS", "ViTConfig", "VisionTransformer", "FAMILIES", "find", "list_models",
           "preset_config"]
