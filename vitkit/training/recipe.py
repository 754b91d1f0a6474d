"""A training module's recipe as one typed part: the optimizer, its learning-rate schedule and how a step runs.

Every training module builds its :class:`Recipe` from its own arguments, by name, in its ``__init__``; the training
base reads that object and nothing else (``TrainingModule.recipe``). :meth:`Recipe.build` gives the optimizer and
the schedule together, and the schedule's length is set once fit has started, on the scheduler that holds it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from vitkit.errors import UsageError

from .optim import ScheduledLR, build_adamw, build_sgd, inverse_sqrt, warmup_cosine, warmup_poly

OPTIMIZERS = ("adamw", "sgd")
DECAYS = ("cosine", "poly", "rsqrt")
NONFINITE = ("stop", "skip")
LR_SCALINGS = ("linear", "sqrt")


class WarmupSchedule:
    """The LR multiplier of an optimizer step: linear warmup over ``warmup_epochs`` (or ``warmup_steps`` where given),
    then down to ``min_lr_ratio`` at the last step, by a cosine (``decay="cosine"``, DeiT's and Swin's) or a
    polynomial of ``power`` (``decay="poly"``, mmsegmentation's ``(1 - progress) ** 0.9``), or by 1/sqrt(step)
    (``decay="rsqrt"``, Vaswani et al.'s ``min(step / warmup, sqrt(warmup / step))``, floored at ``min_lr_ratio``);
    1 until :meth:`set_length` gives the run's length, which a warmup of ``warmup_steps`` before 1/sqrt(step) does
    not need.

    With ``head_epochs`` the groups the optimizer marks ``held`` (the backbone) take :meth:`held`: 0 for the first
    ``head_epochs`` (the head alone learns, on the backbone's features as they are), then a linear warmup of the
    schedule's length into the schedule."""

    def __init__(self, warmup_epochs: float, min_lr_ratio: float, decay: str = "cosine", power: float = 0.9,
                 warmup_steps: int | None = None, head_epochs: float = 0.0) -> None:
        if decay not in DECAYS:
            raise UsageError(f"schedule must be one of {', '.join(DECAYS)}, got {decay!r}")
        self.warmup_epochs, self.min_lr_ratio, self.decay, self.power = warmup_epochs, min_lr_ratio, decay, power
        self.warmup_steps, self.head_epochs = warmup_steps, head_epochs
        self.total: int | None = None
        self.warmup = 0 if warmup_steps is None else warmup_steps
        self.head_steps = 0

    @property
    def needs_length(self) -> bool:
        """Whether the schedule needs the run's length (all but 1/sqrt(step) after a warmup of steps)."""
        return not (self.decay == "rsqrt" and self.warmup_steps is not None)

    def set_length(self, total: int, max_epochs: int | None) -> None:
        steps_per_epoch = total / max_epochs if max_epochs and max_epochs > 0 else total
        self.total = total
        if self.warmup_steps is not None:
            self.warmup = self.warmup_steps if self.decay == "rsqrt" else min(total, self.warmup_steps)
        else:
            self.warmup = min(total, max(1, round(self.warmup_epochs * steps_per_epoch))) if self.warmup_epochs > 0 \
                else 0
        self.head_steps = min(total, round(self.head_epochs * steps_per_epoch))

    def held(self, step: int) -> float:
        """The multiplier of the groups held while the head alone learns (see the class docstring)."""
        if step < self.head_steps or (self.head_epochs > 0 and self.total is None):
            return 0.0
        ramp = min(1.0, (step - self.head_steps + 1) / self.warmup) if self.head_steps and self.warmup else 1.0
        return self(step) * ramp

    def __call__(self, step: int) -> float:
        if self.decay == "rsqrt":
            if self.needs_length and self.total is None:
                return 1.0
            return max(self.min_lr_ratio, inverse_sqrt(step, max(1, self.warmup)))
        if self.total is None:
            return 1.0
        if self.decay == "cosine":
            return warmup_cosine(step, self.warmup, self.total, self.min_lr_ratio)
        return warmup_poly(step, self.warmup, self.total, self.min_lr_ratio, self.power)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a module trains: its optimizer, schedule, EMA and steps.

    The optimizer (AdamW with ``betas`` and ``eps``, or SGD with ``momentum``; ``layer_decay`` for layer-wise LR
    decay, e.g. 0.65 for fine-tuning), the schedule (``warmup_epochs`` of linear warmup, or ``warmup_steps`` where
    given, stepped per optimizer step, then ``schedule``: cosine or poly decay down to ``min_lr``, or rsqrt, the
    Transformer's 1/sqrt(step)), an EMA of the weights (``ema_decay`` per step,
    None: none; validated beside the model as ``val/top1_ema``, or with ``ema_is_model`` the run's model itself:
    validated, tested and saved as ``model.``), what a non-finite loss does (``nonfinite_loss``: ``stop`` ends the run
    with an error, ``skip`` drops that step on every rank and stops after 10 bad steps in a row) and whether the model
    runs under ``torch.compile`` (in place: parameter names stay the plain model's).

    ``lr_batch``: the total batch (devices x nodes x batch x accumulated batches) that ``lr`` and ``min_lr`` are
    given for; a run at another total batch scales both by total / lr_batch (``lr_scaling: linear``, Goyal et al.'s
    rule, DeiT's and MAE's) or by its square root (``sqrt``, for AdamW at small batches, Malladi et al. 2022;
    DINOv2's). None: the LR as given, whatever the batch.

    ``head_epochs``: the first epochs train the head alone (a detector's or depth model's head on its backbone's
    features as they are; the backbone's LR is 0), then the backbone warms up over ``warmup_epochs`` into the
    schedule: a probe-first fine-tune in one run, for modules with a backbone and a head that starts random."""

    lr: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    optimizer: str = "adamw"
    momentum: float = 0.9
    layer_decay: float | None = None
    warmup_epochs: float = 0.0
    warmup_steps: int | None = None
    min_lr: float = 0.0
    schedule: str = "cosine"
    ema_decay: float | None = None
    ema_is_model: bool = False
    nonfinite_loss: str = "stop"
    compile: bool = False
    lr_batch: int | None = None
    lr_scaling: str = "linear"
    head_epochs: float = 0.0

    def __post_init__(self) -> None:
        for name, value, allowed in (("optimizer", self.optimizer, OPTIMIZERS), ("schedule", self.schedule, DECAYS),
                                     ("nonfinite_loss", self.nonfinite_loss, NONFINITE),
                                     ("lr_scaling", self.lr_scaling, LR_SCALINGS)):
            if value not in allowed:
                raise UsageError(f"{name} must be {' or '.join(map(repr, allowed))}, got {value!r}")
        if not self.lr > 0:
            raise UsageError(f"lr must be > 0, got {self.lr!r}")
        if not self.head_epochs >= 0:
            raise UsageError(f"head_epochs must be >= 0 (0: the backbone learns from the first step), got "
                             f"{self.head_epochs!r}")
        steps = self.warmup_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise UsageError(f"warmup_steps must be an integer >= 0 (null: warmup_epochs), got {steps!r}")
        batch = self.lr_batch
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise UsageError(f"lr_batch must be a total batch of 1 or more (null: the lr as given), got {batch!r}")

    def for_batch(self, total: int) -> Recipe:
        """The recipe at a run's total batch: ``lr`` and ``min_lr`` scaled from ``lr_batch`` (itself without one)."""
        if self.lr_batch is None or total == self.lr_batch:
            return self
        factor = total / self.lr_batch if self.lr_scaling == "linear" else (total / self.lr_batch) ** 0.5
        return dataclasses.replace(self, lr=self.lr * factor, min_lr=self.min_lr * factor, lr_batch=total)

    def refuse(self, module: str, **why: str) -> None:
        """A ``ValueError`` naming the first field of ``why`` that is set (not its default) and why ``module`` does
        not take it."""
        for name, reason in why.items():
            if getattr(self, name) != getattr(Recipe, name):
                raise UsageError(f"{module} takes no recipe.{name} ({reason}), got {getattr(self, name)!r}")

    def with_lr(self, lr: float) -> Recipe:
        """The same recipe at another peak LR (a callback that changes the batch changes it before fit)."""
        return dataclasses.replace(self, lr=lr)

    def multiplier(self) -> WarmupSchedule:
        """The schedule: a function of the optimizer step, whose length is set when fit starts."""
        return WarmupSchedule(self.warmup_epochs, self.min_lr / self.lr, self.schedule, warmup_steps=self.warmup_steps,
                              head_epochs=self.head_epochs)

    def build(self, model: nn.Module, fused: bool | None = None, multiplier: Callable[[int], float] | None = None,
              adapter_lr_scale: float = 1.0, held: Callable[[str], bool] | None = None
              ) -> tuple[torch.optim.Optimizer, ScheduledLR]:
        """The optimizer over ``model``'s trainable weights and its per-step scheduler, of ``multiplier`` (a
        function of the step; default :meth:`multiplier`). ``fused``: AdamW's fused kernel (None: where it runs,
        False: torch's default); LoRA adapters at ``adapter_lr_scale`` x ``lr``; the names ``held`` marks are held
        still for ``head_epochs``."""
        if self.optimizer == "sgd":
            opt = build_sgd(model, self.lr, self.weight_decay, self.momentum, held)
        else:
            opt = build_adamw(model, self.lr, self.weight_decay, tuple(self.betas), self.layer_decay, eps=self.eps,
                              fused=fused, adapter_scale=adapter_lr_scale, held=held)
        return opt, ScheduledLR(opt, multiplier if multiplier is not None else self.multiplier())

