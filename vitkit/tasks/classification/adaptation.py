"""The classifier's side of the shared adaptation part (``vitkit.training.adaptation``: ``Full``, ``Frozen``,
``LoRA``, named here too for the class paths that checkpoints and configs of the classifier store): the warning a
frozen backbone gets for a whole-model recipe's augmentation."""

from __future__ import annotations

import logging

from vitkit.training.adaptation import Adaptation, Frozen, Full, LoRA

__all__ = ["Adaptation", "Frozen", "Full", "LoRA", "warn_whole_model_augmentation"]
log = logging.getLogger(__name__)


def warn_whole_model_augmentation(labels, datamodule) -> None:
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
