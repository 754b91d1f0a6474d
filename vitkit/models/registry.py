"""The preset table: model names (timm's) -> their family (config class, model class, preset fields, and what the
family can do), and nothing else.

Nothing here reads weights or resolves pretrained tags: ``vitkit.create_model`` (``vitkit/builder.py``) builds
models and loads weights above this table, as timm's builder sits above its registry.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Any

from torch import nn

from vitkit.errors import UsageError, UsageTypeError

from .families import FAMILIES, Family
from .fields import check_values
from .seq2seq import SEQ2SEQ_PRESETS, Seq2SeqConfig, Seq2SeqTransformer

__all__ = ["FAMILIES", "Family", "check_fields", "find", "list_models", "preset_config"]

FAMILIES["seq2seq"] = Family(Seq2SeqConfig, Seq2SeqTransformer, SEQ2SEQ_PRESETS, images=False)


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a glob pattern, sorted."""
    names = [n for f in FAMILIES.values() for n in f.presets]
    return sorted(fnmatch.filter(names, pattern))


def find(preset: str) -> tuple[str, type, type[nn.Module], dict]:
    """(family, config class, model class, preset fields) of a preset name; a readable error for others."""
    for fam, f in FAMILIES.items():
        if preset in f.presets:
            return fam, f.config, f.model, f.presets[preset]
    names = list_models()  # names it begins, then the nearest by spelling, else those sharing its first word
    close = [n for n in names if n.startswith(preset)] + difflib.get_close_matches(preset, names, n=6, cutoff=0.6)
    close = list(dict.fromkeys(close))[:6] or fnmatch.filter(names, f"*{preset.split('_')[0]}*")[:8]
    raise UsageError(f"unknown model {preset!r}; vitkit.list_models() lists all {len(list_models())}"
                     + (f" (similar: {', '.join(close)})" if close else ""))


def check_fields(name: str, cfg_cls: type, overrides: dict[str, Any]) -> None:
    """Refuse keyword overrides that are not fields of the family's config, naming the fields there are, and
    values of the wrong type or range, naming what the field takes (``fields.check_values``)."""
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    if "token_merging" in overrides and "token_merging" not in fields:
        raise UsageError(f"{name}: token merging is for ViT/DeiT presets only; a {cfg_cls.__name__[:-6]} keeps a "
                         "fixed token grid (Swin's windows partition it), so merged tokens have no place in it")
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UsageTypeError(f"{name}: unknown config field(s) {unknown}; {cfg_cls.__name__} has {sorted(fields)}")
    check_values(name, cfg_cls, overrides)


def preset_config(preset: str, **overrides: Any):
    """The config of a preset with any of its fields overridden by keyword."""
    _, cfg_cls, _, fields = find(preset)
    check_fields(preset, cfg_cls, overrides)
    return cfg_cls(**{**fields, **overrides})
