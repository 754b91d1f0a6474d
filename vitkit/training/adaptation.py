"""How a training module's backbone is adapted, one typed part that every task takes (``--model.adaptation``): the
whole model trains (:class:`Full`), the backbone is frozen and only the head learns (:class:`Frozen`, a linear
probe), or low-rank adapters train in the frozen backbone (:class:`LoRA`, through peft). Each says which weights
train, what mode the backbone runs in, what the checkpoint keeps, and whether the head is fitted on the frozen
features before the first step (``head_init="probe"``).

A module that takes an adaptation gives its ``model``, ``adapted()`` (the backbone, where adapters go) and
``is_head(name)`` (whether a name of ``model``'s parameters or children is the head's: the head trains under every
adaptation), and ``fit_probe_head()`` where it offers the probe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from lightning.pytorch.utilities import rank_zero_info

from vitkit.errors import UsageError, UsageTypeError
from vitkit.models.lora import DEFAULTS as LORA
from vitkit.models.lora import LoraSettings, add_lora, check_adaptation

from .parts import Part

HEAD_INITS = ("random", "probe")
HeadInit = Literal["random", "probe"]


class Adaptation(Part):
    """How the backbone is adapted. ``head_init``: ``random`` (the model's initialisation) or ``probe`` (before the
    first step the head is fitted on the frozen backbone's features: a logistic regression, logged as
    ``val/probe_baseline`` and saved as ``probe.ckpt``; the small-data recipes). ``head_norm``: a classifier's MAE
    BatchNorm without affine parameters before the head, folded into the head in every checkpoint."""

    frozen: ClassVar[bool] = False

    def __init__(self, head_init: HeadInit = "random", head_norm: bool = False) -> None:
        if type(self) is Adaptation:
            raise UsageTypeError("adaptation: choose Full, Frozen or LoRA (Adaptation is what they share)")
        self.head_init, self.head_norm = head_init, head_norm
        if head_init not in HEAD_INITS or (head_init == "probe" and (head_norm or self.frozen)):
            raise UsageError(f"head_init must be 'random' or 'probe' (without head_norm or freeze_backbone: the probe "
                             f"is the fitted head), got {head_init!r} for {type(self).__name__}; where a recipe "
                             "fits the probe first, give --model.adaptation.head_init random too")

    def apply(self, module) -> None:
        """The weights that train set on ``module.model``."""

    def before_fit(self, module) -> None:
        """The head fitted on the frozen features before the first step of a new run, where asked; one line where
        the backbone that stays frozen has no trained weights."""
        trainer = module.trainer
        hp = module.hparams
        keeps = self.frozen or self.head_init == "probe" or isinstance(self, LoRA)
        if keeps and trainer.ckpt_path is None and not (hp.get("pretrained") or hp.get("checkpoint")):
            rank_zero_info(f"warning: {type(self).__name__}" + (" with a probe" if self.head_init == "probe" else "") +
                           " keeps the backbone's weights, and these are random (no --model.checkpoint, no "
                           "--model.pretrained true): the head learns from features of random weights")
        if self.head_init == "probe" and trainer.ckpt_path is None and not trainer.fast_dev_run:
            module.fit_probe_head()

    def train_mode(self, module) -> None:
        """What ``module.train()`` leaves to the part (a frozen backbone back in eval mode)."""

    def adapter_lr_scale(self) -> float:
        """The LR of adapters over the recipe's (1: there are none)."""
        return 1.0

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        """What the checkpoint keeps of the model (all of it, but where adapters trained)."""

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        """What the module reads besides the checkpoint's state dict."""


class Full(Adaptation):
    """Every weight trains."""


class Frozen(Adaptation):
    """Only the head trains: a linear probe.

    The backbone runs as an inference model (its drop path and dropout off) whatever mode the module is put in."""

    frozen: ClassVar[bool] = True

    def apply(self, module) -> None:
        for name, p in module.model.named_parameters():
            p.requires_grad_(module.is_head(name))
        self.train_mode(module)

    def train_mode(self, module) -> None:
        for name, child in module.model.named_children():
            if not module.is_head(name):
                child.eval()


class LoRA(Adaptation):
    """Low-rank adapters (peft) and the head train, nothing else.

    Adapters of ``rank`` on the ``targets`` layers (timm's module names; default the attention's qkv and proj).
    ``alpha``: the adapters' scale is alpha / rank (None: the rank); ``dropout`` on their input; ``parts``: ``qkv``,
    or ``qv`` to adapt only the query and value rows of a fused qkv; ``lr_scale``: their LR is the recipe's x this,
    without layer decay (they start from zero in every block). The checkpoint holds what trained and names the
    backbone, whose weights the module reads again when it loads. The defaults stand in
    ``vitkit.models.lora.DEFAULTS``."""

    def __init__(self, rank: int, alpha: float | None = LORA.alpha, dropout: float = LORA.dropout,
                 targets: list[str] | None = None, parts: str = LORA.parts, lr_scale: float = 10.0,
                 head_init: HeadInit = "random", head_norm: bool = False) -> None:
        super().__init__(head_init, head_norm)
        self.rank, self.alpha, self.dropout, self.targets, self.parts = rank, alpha, dropout, targets, parts
        self.lr_scale = lr_scale
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise UsageError(f"LoRA adapts the backbone with adapters of rank >= 1 (lora_rank), got {rank!r}; without "
                             "adapters, train the whole model or freeze the backbone")
        self.settings = LoraSettings(rank, alpha, dropout, list(targets) if targets else list(LORA.targets), parts)
        check_adaptation(self.settings, False, lr_scale)

    def adapter_lr_scale(self) -> float:
        return self.lr_scale

    def apply(self, module) -> None:
        module.lora_layers = add_lora(module.adapted(), self.settings)  # the backbone frozen but its adapters ...
        for name, p in module.model.named_parameters():
            p.requires_grad_(p.requires_grad or module.is_head(name))  # ... and the head

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        keep_what_trained(module, checkpoint)

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        """The frozen backbone is the module's own, read from the file the checkpoint names."""
        own = module.state_dict()
        checkpoint["state_dict"] = {**{k: v for k, v in own.items() if k not in checkpoint["state_dict"]},
                                    **checkpoint["state_dict"]}


def keep_what_trained(module, checkpoint: dict) -> None:
    """Drop the frozen backbone's weights (and their EMA copies) from ``checkpoint``: it keeps the adapters, the head
    and the hyper-parameters that name the backbone (its file made absolute, its tag), which loading reads again."""
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    drop = {prefix + n for n in frozen for prefix in ("model.", "ema.module.")}
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in drop}
    hp = checkpoint.get("hyper_parameters")
    if hp is not None:  # TrainingModule cleared them for a checkpoint that holds every weight; this one does not
        source = module.hparams.checkpoint
        hp.update(pretrained=module.hparams.pretrained,
                  checkpoint=str(Path(os.path.expanduser(source)).resolve()) if source else None)
    checkpoint["lora"] = {"adapted": list(module.lora_layers), "backbone": hp.get("checkpoint") if hp else None}


def headless_backbone(model_name: str, pretrained: bool, checkpoint: str | None, img_size: Any,
                      model_overrides: dict[str, Any] | None):
    """The backbone a dense task's model is built on: ``model_name`` without its classifier (``num_classes=0``), its
    weights by tag (``pretrained``) or from ``checkpoint``, at ``img_size`` where given; what its load did is logged."""
    import vitkit

    overrides = dict(model_overrides or {})
    if img_size is not None:
        overrides["img_size"] = img_size
    backbone = vitkit.create_model(model_name, pretrained=pretrained, checkpoint=checkpoint, num_classes=0,
                                   **overrides)
    if getattr(backbone, "load_report", None) is not None:
        rank_zero_info(str(backbone.load_report))
    return backbone


class AdaptsBackbone:
    """A training module's hooks for its ``adaptation`` part where its ``model`` holds a ``backbone`` and everything
    outside it is the head (a detector's tokens and heads, a depth model's head): adapters go in the backbone, a
    frozen backbone stays in eval mode, and the checkpoint keeps what the part says with the backbone's config. Put
    before ``TrainingModule`` in the bases."""

    def refuse_probe(self, head: str) -> None:
        """One line where the adaptation asks for a probe-fitted head and the model's ``head`` starts random."""
        if self.adaptation.head_init == "probe":
            raise UsageError(f"head_init 'probe' fits a linear head on frozen features; {head} starts random: give "
                             "--model.adaptation.head_init random")

    def adapter_lr_scale(self) -> float:
        return self.adaptation.adapter_lr_scale()

    def adapted(self):
        """Where LoRA adapters go: the backbone."""
        return self.model.backbone

    def held_back(self):
        """What ``recipe.head_epochs`` holds still while the head learns alone: the backbone."""
        return lambda name: not self.is_head(name)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """While the head learns alone (``recipe.head_epochs``), the backbone, whose LR is 0, computes no gradients
        in a run of one process with no adapters; DDP's reducer expects every weight's, and LoRA's checkpoints are
        written from which weights train, so those runs compute them as before."""
        if hasattr(super(), "on_train_batch_start"):
            super().on_train_batch_start(batch, batch_idx)
        if self.recipe.head_epochs <= 0 or isinstance(self.adaptation, LoRA) or self.trainer.world_size > 1:
            return
        schedule = getattr(self.lr_schedulers(), "schedule", None)
        hold = self.global_step < getattr(schedule, "head_steps", 0)
        flags = getattr(self, "_held_flags", None)
        if hold and flags is None:
            self._held_flags = {n: p.requires_grad for n, p in self.model.named_parameters() if not self.is_head(n)}
            for n, p in self.model.named_parameters():
                if n in self._held_flags:
                    p.requires_grad_(False)
        elif not hold and flags is not None:
            for n, p in self.model.named_parameters():
                if n in flags:
                    p.requires_grad_(flags[n])
            self._held_flags = None

    @staticmethod
    def is_head(name: str) -> bool:
        """Whether a name of the model's parameters or children is outside the backbone: it trains under every
        adaptation."""
        return name.partition(".")[0] != "backbone"

    def train(self, mode: bool = True):
        """A frozen backbone stays in eval mode: its drop path and dropout off, as at inference."""
        super().train(mode)
        if mode:
            self.adaptation.train_mode(self)
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from .hparams import record_config

        super().on_save_checkpoint(checkpoint)
        if checkpoint.get("hyper_parameters") is not None:  # the backbone file's shapes: rebuilt without the file
            record_config(self.model.backbone, checkpoint["hyper_parameters"])
        self.adaptation.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.adaptation.load(self, checkpoint)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.adaptation.before_fit(self)
