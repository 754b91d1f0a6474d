"""What a model name means, without building the model: the preset behind a timm tag, torchvision weights or a hub
repo (``preset_of``), its family, and the config its weights were trained with (``get_config``: image size,
classes, mean, std, crop_pct, interpolation). The data's preprocessing reads it; ``vitkit.create_model`` builds on
it."""

from __future__ import annotations

from typing import Any

from vitkit.errors import UsageError

from ..models.config import pair
from ..models.registry import FAMILIES, Family, check_fields, find
from . import hub
from .load import read_checkpoint


def preset_of(name: str) -> str:
    """The preset behind a name: itself, or the preset of a timm tag ('vit_small_patch16_224.augreg_in1k'),
    torchvision weights ('ViT_B_16_Weights.IMAGENET1K_V1') or a hub repo ('hf-hub:timm/...')."""
    if name.startswith("hf-hub:") or hub.TV_WEIGHTS.match(name):
        source = hub.resolve(name)
        if source.preset:
            return source.preset
        ck = read_checkpoint(source.fetch())
        if ck.model_name is None:
            raise UsageError(f"{name}: the repo's config.json names no architecture")
        return ck.model_name
    return hub.split_tag(name)[0] if "." in name else name


def family(name: str) -> str:
    """'vit', 'swin' or 'seq2seq' for a preset name or a pretrained name."""
    return find(preset_of(name))[0]


def capabilities(name: str) -> Family:
    """What the family of a preset name or a pretrained name can do (``vitkit.models.registry.Family``)."""
    return FAMILIES[family(name)]


def get_config(name: str, **overrides: Any):
    """The config of preset ``name`` with any of its fields overridden by keyword. A pretrained name
    (``vit_small_patch16_224.augreg_in1k``, ``ViT_B_16_Weights.IMAGENET1K_V1``) gives the config its
    weights were trained with: their image size, classes, mean, std, crop_pct and interpolation."""
    _, cfg_cls, _, preset = find(preset_of(name))
    check_fields(name, cfg_cls, overrides)
    weights = _weights_config(hub.resolve(name).config, preset) if "." in name and not name.startswith("hf-hub:") \
        else {}
    return cfg_cls(**{**preset, **weights, **overrides})


def _weights_config(config: dict, preset: dict) -> dict:
    """Config fields of a timm tag or torchvision weights, as overrides of the preset (no download)."""
    config = dict(config)
    if pair(config["img_size"]) == pair(preset.get("img_size", 224)):
        del config["img_size"]  # the preset's own, as it wrote it
    return config
