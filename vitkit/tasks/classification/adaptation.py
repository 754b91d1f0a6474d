"""How a classifier's backbone is adapted, as one typed part of :class:`~vitkit.lit.ImageClassifier`: the whole model
trains (:class:`Full`), the backbone is frozen and only the head learns (:class:`Frozen`, a linear probe), or
low-rank adapters train in the frozen backbone (:class:`LoRA`, through peft). Each says which weights train, what
mode the backbone runs in, what the checkpoint keeps, and what happens before the first step: the head fitted on the
frozen features (``head_init="probe"``, ``small_data.py``), or a note on the recipe that suits the data."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from vitkit.lora import DEFAULTS as LORA
from vitkit.lora import LoraSettings, add_lora, check_adaptation
from vitkit.training.parts import Part

from .probe import HeadNorm, fold_into_checkpoint, unfold_from_checkpoint
from .small_data import keep_what_trained, suggest_small_data_recipe

log = logging.getLogger(__name__)
HEAD_INITS = ("random", "probe")
HeadInit = Literal["random", "probe"]


class Adaptation(Part):
    """How the backbone is adapted. ``head_init``: ``random`` (the model's initialisation) or ``probe`` (before the
    first step the head is fitted on the frozen backbone's features: a logistic regression, logged as
    ``val/probe_baseline`` and saved as ``probe.ckpt``; the ``finetune_small_data`` recipe). ``head_norm``: MAE's
    BatchNorm without affine parameters before the head (``probe.py``), folded into the head in every checkpoint."""

    frozen: ClassVar[bool] = False

    def __init__(self, head_init: HeadInit = "random", head_norm: bool = False) -> None:
        if type(self) is Adaptation:
            raise TypeError("adaptation: choose Full, Frozen or LoRA (Adaptation is what they share)")
        self.head_init, self.head_norm = head_init, head_norm
        if head_init not in HEAD_INITS or (head_init == "probe" and (head_norm or self.frozen)):
            raise ValueError(f"head_init must be 'random' or 'probe' (without head_norm or freeze_backbone: the probe "
                             f"is the fitted head), got {head_init!r}")

    def apply(self, module) -> None:
        """The weights that train set on ``module.model``; the head's norm made where asked."""
        module.head_norm = HeadNorm(module.model) if self.head_norm else None

    def before_fit(self, module, dm) -> None:
        """A probe-fitted head before the first step of a new run, or the small-data recipe suggested."""
        trainer = module.trainer
        if self.head_init == "probe" and trainer.ckpt_path is None and not trainer.fast_dev_run:
            module.fit_probe_head()
        elif self.head_init == "random":
            suggest_small_data_recipe(module, dm)

    def train_mode(self, module) -> None:
        """What ``module.train()`` leaves to the part (a frozen backbone back in eval mode)."""

    def adapter_lr_scale(self) -> float:
        """The LR of adapters over the recipe's (1: there are none)."""
        return 1.0

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        if module.head_norm is not None:  # the file is a plain classifier; the probe as trained rides beside it
            fold_into_checkpoint(module.head_norm, module.model, checkpoint)

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        if module.head_norm is not None:
            unfold_from_checkpoint(module.model, checkpoint)


class Full(Adaptation):
    """Every weight trains."""


class Frozen(Adaptation):
    """Only the head (``head*``) trains: a linear probe.

    The backbone runs as an inference model (its drop path and dropout off) whatever mode the module is put in."""

    frozen: ClassVar[bool] = True

    def apply(self, module) -> None:
        for name, p in module.model.named_parameters():
            p.requires_grad_(name.startswith("head"))
        self.train_mode(module)
        super().apply(module)

    def before_fit(self, module, dm) -> None:
        super().before_fit(module, dm)
        _warn_whole_model_augmentation(module.labels, dm)

    def train_mode(self, module) -> None:
        for name, child in module.model.named_children():
            if not name.startswith("head"):
                child.eval()


class LoRA(Adaptation):
    """Low-rank adapters (peft) and the head train, nothing else.

    Adapters of ``rank`` on the ``targets`` layers (timm's module names; default the attention's qkv and proj).
    ``alpha``: the adapters' scale is alpha / rank (None: the rank); ``dropout`` on their input; ``parts``: ``qkv``,
    or ``qv`` to adapt only the query and value rows of a fused qkv; ``lr_scale``: their LR is the recipe's x this,
    without layer decay (they start from zero in every block). The checkpoint holds what trained and names the
    backbone, whose weights the module reads again when it loads. The defaults stand in ``vitkit.lora.DEFAULTS``."""

    def __init__(self, rank: int, alpha: float | None = LORA.alpha, dropout: float = LORA.dropout,
                 targets: list[str] | None = None, parts: str = LORA.parts, lr_scale: float = 10.0,
                 head_init: HeadInit = "random", head_norm: bool = False) -> None:
        super().__init__(head_init, head_norm)
        self.rank, self.alpha, self.dropout, self.targets, self.parts = rank, alpha, dropout, targets, parts
        self.lr_scale = lr_scale
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA adapts the backbone with adapters of rank >= 1 (lora_rank), got {rank!r}; without "
                             "adapters, train the whole model or freeze the backbone")
        self.settings = LoraSettings(rank, alpha, dropout, list(targets) if targets else list(LORA.targets), parts)
        check_adaptation(self.settings, False, lr_scale)

    def adapter_lr_scale(self) -> float:
        return self.lr_scale

    def apply(self, module) -> None:
        module.lora_layers = add_lora(module.model, self.settings)  # everything frozen but the adapters ...
        for name, p in module.model.named_parameters():
            p.requires_grad_(p.requires_grad or name.startswith("head"))  # ... and the head
        super().apply(module)

    def save(self, module, checkpoint: dict[str, Any]) -> None:
        super().save(module, checkpoint)
        keep_what_trained(module, checkpoint)

    def load(self, module, checkpoint: dict[str, Any]) -> None:
        """The frozen backbone is the module's own, read from the file the checkpoint names."""
        super().load(module, checkpoint)
        own = module.state_dict()
        checkpoint["state_dict"] = {**{k: v for k, v in own.items() if k not in checkpoint["state_dict"]},
                                    **checkpoint["state_dict"]}


def _warn_whole_model_augmentation(labels, datamodule) -> None:
    """A frozen backbone with a fine-tuning recipe's augmentation, made for training the whole model: its head
    learns from features of mixed, erased and RandAugmented images, and lands far below a probe of the same
    features."""
    data = datamodule.augmentation() if hasattr(datamodule, "augmentation") else getattr(datamodule, "hparams", {})
    heavy = [f"{k} {v}" for k, v in (("mixup", labels.mixup), ("cutmix", labels.cutmix),
                                      ("re_prob", data.get("re_prob")), ("auto_augment", data.get("auto_augment")))
             if v]
    if heavy:
        log.warning("a frozen backbone (--model.adaptation Frozen) with %s: this augmentation is meant for training "
                    "the whole model; a frozen backbone's head learns better with the linear-probe recipe: "
                    "`vitkit train fit -c linear_probe --model.checkpoint BACKBONE --data.root DATA`", ", ".join(heavy))
