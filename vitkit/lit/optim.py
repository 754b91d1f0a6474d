"""The DeiT/Swin optimisation recipe: AdamW groups without decay on norms and embeddings, layer-wise LR
decay, and a per-step linear warmup followed by cosine decay."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")  # ViT: blocks.{i}.
_STAGE_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.blocks\.(\d+)\.")  # Swin: layers.{s}.blocks.{j}.
_STAGE = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # Swin patch merging: layers.{s}.downsample


def _depths(model: nn.Module) -> list[int]:
    """Blocks per stage: [depth] for ViT, the stage depths for hierarchical models."""
    cfg = getattr(model, "cfg", None)
    depths = getattr(cfg, "depths", None) or [getattr(cfg, "depth", 0)]
    return list(depths)


def layer_id(name: str, depths: list[int]) -> int:
    """0 for the embeddings, 1..L for the blocks in order, L+1 for the final norm and head."""
    m = _STAGE_BLOCK.search(name)
    if m:
        s, j = int(m.group(1)), int(m.group(2))
        return sum(depths[:s]) + j + 1
    m = _BLOCK.search(name)
    if m:
        return int(m.group(1)) + 1
    m = _STAGE.search(name)
    if m:  # downsampling at the start of stage s belongs with the block before it
        return sum(depths[: int(m.group(1))])
    if any(k in name for k in ("patch_embed", "cls_token", "reg_token", "pos_embed", "absolute_pos_embed")):
        return 0
    return sum(depths) + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """AdamW groups: no weight decay on 1-D params (norms, biases) and the model's ``no_weight_decay()``
    names (positions, class token, relative-position tables); with ``layer_decay`` each layer's LR is
    scaled by ``layer_decay ** (L + 1 - layer_id)`` (BEiT/MAE fine-tuning)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    depths = _depths(model)
    num_layers = sum(depths) + 1
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip or name.split(".")[-1] in skip
        lid = layer_id(name, depths) if layer_decay is not None else num_layers
        scale = layer_decay ** (num_layers - lid) if layer_decay is not None else 1.0
        g = groups.setdefault((lid, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                 "lr_scale": scale, "names": []})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear from ~0 to 1 over ``warmup_steps``, then cosine down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def inverse_sqrt(step: int, warmup_steps: int) -> float:
    """Vaswani et al. (2017): linear warmup, then decay with 1/sqrt(step); peaks at 1 when step = warmup."""
    step = step + 1
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


def scaled_lambda(fn, group_scales: list[float]):
    """One LambdaLR lambda per group: the schedule times the group's layer-decay scale."""
    return [lambda step, s=s: fn(step) * s for s in group_scales]


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                layer_decay: float | None, eps: float = 1e-8) -> torch.optim.AdamW:
    groups = param_groups(model, weight_decay, layer_decay)
    for g in groups:
        g.pop("names")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
