"""The backbone families and what each can do: a family is its model module, its presets and one row of
``FAMILIES``. The code that would branch on a family's name asks its row instead (``vitkit.checkpoints.names
.capabilities``). The encoder-decoder's row is added by the registry (``registry.py``), as it is built on the image
families' encoders."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

from .swin import SwinConfig, SwinTransformer
from .swin_presets import SWIN_PRESETS
from .vit import VisionTransformer, ViTConfig
from .vit_presets import VIT_PRESETS


class Family(NamedTuple):
    """A family of presets and what it can do. The code that would branch on a family's name asks here instead, so
    that a new family is its model module, its presets and one row below."""

    config: type
    model: type[nn.Module]
    presets: dict[str, dict]  # keyed by timm's names
    images: bool = True  # an image encoder: classifiers, segmenters, teachers and image-to-text take it
    mim: tuple[str, ...] = ()  # the masked-image-modelling objectives it pre-trains with, its default first
    dino: bool = False  # DINO self-distillation (a class token beside the patch tokens)
    token_merging: bool = False  # ToMe (a token sequence; a fixed grid of windows has no place for merged tokens)
    # the sizes a dynamic-size export takes: "patch_multiples" (any multiple of the patch), "padded" (any size from
    # the model's min_input_size(), padded inside and traced size-obliviously), None: no export
    export_sizes: str | None = None
    # where its state dict numbers the units its depth counts (ViT's blocks, Swin's stages), and that count in a
    # config: a backbone file that records no model is matched to the presets by it
    depth_key: str = "blocks"
    depth: Callable[[Any], int] = operator.attrgetter("depth")


# the image encoders; the encoder-decoder built on them is the registry's row (vitkit/models/registry.py)
FAMILIES: dict[str, Family] = {
    "vit": Family(ViTConfig, VisionTransformer, VIT_PRESETS, mim=("mae", "simmim"), dino=True, token_merging=True,
                  export_sizes="patch_multiples"),
    "swin": Family(SwinConfig, SwinTransformer, SWIN_PRESETS, mim=("simmim",), export_sizes="padded",
                   depth_key="layers", depth=lambda cfg: len(cfg.depths)),
}
