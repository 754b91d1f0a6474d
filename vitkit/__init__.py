"""vitkit: ViT and Swin on one attention core, with Lightning training, checkpoint loading and benchmarks."""

from .builder import create_mim, create_model, family, get_config
from .checkpoints import load_checkpoint, read_checkpoint, save_pretrained
from .models import list_models

__version__ = "0.1.0"
__all__ = ["create_mim", "create_model", "family", "get_config", "list_models", "load_checkpoint", "read_checkpoint",
           "save_pretrained"]
