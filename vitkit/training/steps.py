"""A batch fitted to a small training split: :class:`StepsPerEpoch` keeps an epoch from being two optimizer steps,
lowering the batch (and the LR with it) until the split gives at least ``min_steps`` of them. Any task's recipe
takes it (``vitkit.lit.StepsPerEpoch``: the classifier's and the segmenter's small-data recipes).

``vitkit train`` decides it before the module is built (:meth:`StepsPerEpoch.decide` on the built data module and
the trainer, then the module is built with the batch's LR); a Trainer given the callback by hand has it decided when
fit sets the data up."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from vitkit.errors import UsageError


@dataclass(frozen=True)
class BatchFit:
    """A lowered batch: ``n`` training images gave ``steps`` steps an epoch at ``batch``, ``new`` gives ``new_steps``.
    ``lr`` is the LR it runs at where the recipe does not scale it by its own rule (``recipe.lr_batch``)."""

    n: int
    batch: int
    new: int
    world: int
    lr: float | None = None
    rule: str = ""

    def line(self) -> str:
        steps, new_steps = self.n // (self.batch * self.world), self.n // (self.new * self.world)
        lr = f", at lr {self.lr:.3g} ({self.rule})" if self.lr is not None else ""
        return (f"data: {self.n} training images give {steps} step(s) of batch {self.batch} an epoch; batch {self.new} "
                f"gives {new_steps}{lr}")


class StepsPerEpoch(L.Callback):
    """At least ``min_steps`` optimizer steps per epoch.

    Where the training split holds fewer than
    ``min_steps`` batches, the batch is lowered to ``len(train) // min_steps`` (at least ``min_batch``), and the run
    says so in one line. The LR follows by the recipe's own rule (``recipe.lr_batch``); a recipe without one has its
    ``lr`` lowered (linearly for SGD, by the square root for AdamW)."""

    def __init__(self, min_steps: int = 10, min_batch: int = 4) -> None:
        if min_steps < 1 or min_batch < 1:
            raise UsageError(f"StepsPerEpoch takes min_steps >= 1 and min_batch >= 1, got {min_steps}, {min_batch}")
        self.min_steps, self.min_batch = min_steps, min_batch
        self.done = False

    def decide(self, dm: L.LightningDataModule | None, world: int, recipe=None) -> BatchFit | None:
        """The batch (and LR) ``dm``'s training split is run at by ``world`` processes (x accumulated batches), given
        the module's ``recipe``; None where the batch stays. The data module's batch is set; the LR is the caller's
        to give the module."""
        if self.done or dm is None or "batch_size" not in getattr(dm, "hparams", {}):
            return None
        self.done = True
        if not hasattr(dm, "train_set"):
            dm.setup("fit")
        try:
            n = len(getattr(dm, "train_set", ()))
        except TypeError:  # a stream: its length is not known before it is read
            return None
        batch = dm.hparams.batch_size
        if not n or n // (batch * world) >= self.min_steps:
            return None
        new = max(self.min_batch, n // (self.min_steps * world))
        if new >= batch:
            return None
        dm.hparams.batch_size = new
        if recipe is None or recipe.lr_batch is not None:  # the LR follows the run's total batch by the recipe
            return BatchFit(n, batch, new, world)
        sgd = recipe.optimizer == "sgd"  # SGD's LR follows the batch linearly, AdamW's by its square root
        lr = recipe.lr * (new / batch if sgd else (new / batch) ** 0.5)  # (Malladi et al., 2022)
        return BatchFit(n, batch, new, world, lr, f"lr x {new}/{batch}" if sgd else f"lr x sqrt({new}/{batch})")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """A Trainer given the callback by hand: decided as fit sets the data up, the module's recipe changed."""
        if stage != "fit" or self.done:
            return
        recipe = getattr(pl_module, "recipe", None)
        fit = self.decide(trainer.datamodule, max(1, trainer.world_size) * trainer.accumulate_grad_batches, recipe)
        if fit is None:
            return
        if fit.lr is not None:
            pl_module.recipe = recipe.with_lr(fit.lr)
            if isinstance(pl_module.hparams.get("recipe"), dict):  # what ran, for the checkpoint
                pl_module.hparams.recipe = {**pl_module.hparams.recipe, "lr": fit.lr}
        rank_zero_info(fit.line())
