"""The DeiT/Swin optimisation recipe: AdamW groups without decay on norms and embeddings, layer-wise LR
decay, and a per-step linear warmup followed by cosine decay."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn

MERGE_WITH_PREVIOUS = 99999.0  # a group_matcher suffix: join the group before (the final norm, timm's convention)


def layer_ids(model: nn.Module) -> dict[str, int]:
    """Depth of each parameter by the model's ``group_matcher()`` (timm's convention): 0 for the stem,
    then one per block in order; names no pattern matches (the head) get the largest id."""
    rules = []
    for ordinal, spec in enumerate(model.group_matcher(coarse=False).values()):
        for pattern, suffix in spec if isinstance(spec, (list, tuple)) else [(spec, None)]:
            rules.append((re.compile(pattern), (float(ordinal),), suffix))

    def key(name: str) -> tuple[float, ...]:
        for pattern, prefix, suffix in rules:
            m = pattern.match(name)
            if m:
                return prefix + tuple(float(g) for g in m.groups() if g is not None) + tuple(map(float, suffix or ()))
        return (math.inf,)

    keys = {name: key(name) for name, _ in model.named_parameters()}
    ids, lid = {}, -1
    for k in sorted(set(keys.values())):
        if lid < 0 or k[-1] != MERGE_WITH_PREVIOUS:
            lid += 1
        ids[k] = lid
    return {name: ids[k] for name, k in keys.items()}


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None,
                 adapter_scale: float = 1.0, held: Callable[[str], bool] | None = None) -> list[dict]:
    """AdamW groups: no weight decay on 1-D params (norms, biases) and the model's ``no_weight_decay()``
    names (positions, class token, relative-position tables); with ``layer_decay`` each layer's LR is
    scaled by ``layer_decay ** (L - layer_id)`` with layers from ``group_matcher()`` (BEiT/MAE fine-tuning,
    the same groups as timm's ``param_groups_layer_decay``). LoRA adapters (``lora_A``, ``lora_B``) form a group
    of their own at ``adapter_scale`` x the LR, without layer decay: they start from zero in every block, and an
    early block's adapter at the decayed LR of its pretrained weights would hardly move. The names ``held`` marks form
    groups of their own with ``held: True``: the schedule holds them still while the head alone learns
    (``Recipe.head_epochs``)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    ids = layer_ids(model) if layer_decay is not None else {}
    top = max(ids.values(), default=0)
    groups: dict[tuple[int, bool, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip or name.split(".")[-1] in skip
        lid = ids.get(name, top)
        scale = layer_decay ** (top - lid) if layer_decay is not None else 1.0
        if ".lora_" in name:
            lid, scale = -1, adapter_scale
        hold = held is not None and held(name)
        g = groups.setdefault((lid, no_decay, hold), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                      "lr_scale": scale, "names": [], "held": hold})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear from ~0 to 1 over ``warmup_steps``, then cosine down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_poly(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, power: float = 0.9) -> float:
    """LR multiplier: linear from ~0 to 1 over ``warmup_steps``, then ``(1 - progress) ** power`` down to
    ``min_lr_ratio`` (mmsegmentation's ``PolyLR``, the schedule of its UperNet and DPT recipes)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress) ** power


def inverse_sqrt(step: int, warmup_steps: int) -> float:
    """Vaswani et al. (2017): linear warmup, then decay with 1/sqrt(step); peaks at 1 when step = warmup."""
    step = step + 1
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


def scaled_lambda(fn, group_scales: list[float], held: list[bool] | None = None):
    """One LambdaLR lambda per group: the schedule times the group's layer-decay scale; a ``held`` group's by the
    schedule's ``held`` multiplier where it has one (0 while the head alone learns)."""
    held = held or [False] * len(group_scales)
    hold = getattr(fn, "held", fn)
    return [lambda step, s=s, f=(hold if h else fn): f(step) * s for s, h in zip(group_scales, held, strict=True)]


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """The LR of every group, stepped per optimizer step: ``schedule(step)`` times the group's layer-decay scale
    (``lr_scale``). It keeps ``schedule``, an object whose length the training base may set once fit has started;
    its state is the step alone, as LambdaLR's, so a checkpoint holds no object of vitkit's."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule) -> None:
        self.schedule = schedule
        super().__init__(optimizer, scaled_lambda(schedule, [g["lr_scale"] for g in optimizer.param_groups],
                                                  [g.get("held", False) for g in optimizer.param_groups]))

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("schedule", None)
        return state


FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")  # where torch has a fused AdamW kernel


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                layer_decay: float | None, eps: float = 1e-8, fused: bool | None = None,
                adapter_scale: float = 1.0, held: Callable[[str], bool] | None = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`. ``fused`` (by default wherever every weight is a floating-point tensor on
    a device with the kernel) updates all weights in one kernel: the same update as the loop over weights that
    is torch's default on CPU, in less time (docs/training.md gives the figure).
    ``fused=False`` gives torch's default, for where Lightning refuses a fused optimizer (the training modules
    decide: ``_may_fuse``)."""
    groups = param_groups(model, weight_decay, layer_decay, adapter_scale, held)
    for g in groups:
        g.pop("names")
    if fused is None:
        fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for g in groups for p in g["params"])
    # Not fused means None, not False: torch then picks its own default (foreach on GPUs); an explicit False
    # would also turn foreach off there.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def build_sgd(model: nn.Module, lr: float, weight_decay: float, momentum: float,
              held: Callable[[str], bool] | None = None) -> torch.optim.SGD:
    """SGD with momentum over the trainable parameters (the groups of :func:`param_groups`): MAE's linear probe
    (there with LARS, which equals SGD for a single linear layer up to its trust ratio)."""
    groups = param_groups(model, weight_decay, held=held)
    for g in groups:
        g.pop("names")
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)
