"""Model families and their presets: ``create_model(name, **overrides)`` and ``list_models()``."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any

from torch import nn

from .seq2seq import SEQ2SEQ_PRESETS, Seq2SeqConfig, Seq2SeqTransformer
from .swin import SWIN_PRESETS, SwinConfig, SwinTransformer
from .vit import VIT_PRESETS, VisionTransformer, ViTConfig

# family -> (config class, model class, presets keyed by timm's names)
FAMILIES: dict[str, tuple[type, type[nn.Module], dict[str, dict]]] = {
    "vit": (ViTConfig, VisionTransformer, VIT_PRESETS),
    "swin": (SwinConfig, SwinTransformer, SWIN_PRESETS),
    "seq2seq": (Seq2SeqConfig, Seq2SeqTransformer, SEQ2SEQ_PRESETS),
}


def family(name: str) -> str:
    """'vit', 'swin' or 'seq2seq' for a preset name."""
    cfg_cls = _find(name)[0]  # raises the readable unknown-model error
    return next(fam for fam, (c, _, _) in FAMILIES.items() if c is cfg_cls)


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


def create_model(name: str | None = None, *, checkpoint: str | os.PathLike | None = None, strict: bool = True,
                 use_ema: bool = False, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (timm's naming), e.g. ``create_model("vit_small_patch16_224", num_classes=10)``.

    With ``checkpoint`` (a file or folder of any format in :mod:`vitkit.checkpoints`) the weights are
    loaded too. Settings the file records (a vitkit export, a Lightning checkpoint, a timm or transformers
    config.json) are applied first, then ``overrides``; ``name`` may then be omitted. Without an explicit
    ``num_classes`` the checkpoint's classifier size is kept; with another one a new head is made."""
    ck = None
    if checkpoint is not None:
        from ..checkpoints import load_checkpoint, read_checkpoint  # checkpoints imports models

        ck = read_checkpoint(checkpoint, use_ema)
        name = name or ck.model_name
        if name is None:
            raise ValueError(f"{checkpoint} does not record which model it holds ({ck.format} format); "
                             "pass the preset name, e.g. create_model('vit_base_patch16_224', checkpoint=...)")
        # settings recorded for another preset do not apply, except a transformers config: it describes
        # the whole architecture, so it fits any preset of its family
        applies = ck.model_name in (None, name) or ck.format.startswith("transformers")
        fields = {f.name for f in dataclasses.fields(_find(name)[0])}
        recorded = {k: v for k, v in ck.overrides.items() if k in fields} if applies else {}
        if "num_classes" not in recorded and ck.num_classes is not None:
            recorded["num_classes"] = ck.num_classes
        overrides = {**recorded, **overrides}
    if name is None:
        raise TypeError("create_model needs a preset name (or a checkpoint that records one)")
    _, model_cls, _ = _find(name)
    model = model_cls(get_config(name, **overrides))
    model.name = name
    if ck is not None:
        model.load_report = load_checkpoint(model, ck, strict=strict)
        model.class_names = ck.class_names
    return model


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a glob pattern, sorted."""
    names = [n for _, _, presets in FAMILIES.values() for n in presets]
    return sorted(fnmatch.filter(names, pattern))

