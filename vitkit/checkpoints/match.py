"""Which presets a checkpoint's tensors fit: for a backbone file that does not record its model (a bare state dict
of timm's, Meta's or vitkit's names), the preset is the one its shapes fit, as ``load_checkpoint`` would load it
(positions resampled, a new head). Presets are built on the meta device (no memory, no initialisation), after a
first cut by width, patch size and depth."""

from __future__ import annotations

import re

import torch

from ..models.registry import FAMILIES, Family, preset_config
from .load import Checkpoint, fit


def _shape_facts(sd: dict, depth_key: str) -> tuple[int, int, int] | None:
    """(width, patch size, depth: the numbered units under ``depth_key``) of a state dict in vitkit's names, or None
    if it has no patch embedding or no such units."""
    w = sd.get("patch_embed.proj.weight")
    if w is None or w.dim() != 4:
        return None
    units = {int(m.group(1)) for k in sd if (m := re.match(rf"{re.escape(depth_key)}\.(\d+)\.", k))}
    return (w.shape[0], w.shape[-1], len(units)) if units else None


def _facts_of(family: Family, cfg) -> tuple[int, int, int]:
    patch = cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[-1]
    return cfg.embed_dim, patch, family.depth(cfg)


def fitting_presets(ck: Checkpoint) -> list[str]:
    """The presets whose every tensor ``ck`` fills (those that need the fewest adaptations first, then by name)."""
    classes = ck.num_classes
    scored = []
    for family in (f for f in FAMILIES.values() if f.images):
        facts = _shape_facts(ck.state_dict, family.depth_key)
        if facts is None:
            continue
        for name in family.presets:
            cfg = preset_config(name)
            if _facts_of(family, cfg) != facts:
                continue
            extra = {} if classes is None else {"num_classes": classes}
            with torch.device("meta"):
                model = family.model(preset_config(name, **extra))
            model.name = name
            try:
                _, report = fit(model, ck)
            except ValueError:  # positions that no grid of this preset's prefix tokens explains
                continue
            if report.ok:
                scored.append((len(report.adapted), name))
    return [name for _, name in sorted(scored)]
