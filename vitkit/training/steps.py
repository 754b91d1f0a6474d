"""A batch fitted to a small training split: :class:`StepsPerEpoch` keeps an epoch from being two optimizer steps,
lowering the batch (and the LR with it) until the split gives at least ``min_steps`` of them. Any task's recipe
takes it (``vitkit.lit.StepsPerEpoch``: the classifier's and the segmenter's small-data recipes); ``vitkit train``
runs it once the data module is set up, before the first step."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from vitkit.errors import UsageError


class StepsPerEpoch(L.Callback):
    """At least ``min_steps`` optimizer steps per epoch.

    Where the training split holds fewer than
    ``min_steps`` batches, the batch is lowered to ``len(train) // min_steps`` (at least ``min_batch``), and the run
    says so in one line. The LR follows by the recipe's own rule (``recipe.lr_batch``); a recipe without one has its
    ``lr`` lowered here (linearly for SGD, by the square root for AdamW)."""

    def __init__(self, min_steps: int = 10, min_batch: int = 4) -> None:
        if min_steps < 1 or min_batch < 1:
            raise UsageError(f"StepsPerEpoch takes min_steps >= 1 and min_batch >= 1, got {min_steps}, {min_batch}")
        self.min_steps, self.min_batch = min_steps, min_batch
        self.done = False

    def fit_to_data(self, trainer: L.Trainer, module: L.LightningModule, dm: L.LightningDataModule | None) -> None:
        if self.done or dm is None or "batch_size" not in getattr(dm, "hparams", {}):
            return
        self.done = True
        if not hasattr(dm, "train_set"):
            dm.setup("fit")
        try:
            n = len(getattr(dm, "train_set", ()))
        except TypeError:  # a stream: its length is not known before it is read
            return
        world = max(1, trainer.world_size) * trainer.accumulate_grad_batches
        batch = dm.hparams.batch_size
        if not n or n // (batch * world) >= self.min_steps:
            return
        new = max(self.min_batch, n // (self.min_steps * world))
        if new >= batch:
            return
        dm.hparams.batch_size = new
        recipe = getattr(module, "recipe", None)
        if recipe is not None and recipe.lr_batch is not None:  # the LR follows the run's total batch by the recipe
            rank_zero_info(f"data: {n} training images give {n // (batch * world)} step(s) of batch {batch} an epoch; "
                           f"batch {new} gives {n // (new * world)}")
            return
        lr, sgd = (recipe.lr, recipe.optimizer == "sgd") if recipe is not None else (None, False)
        if lr is not None:  # SGD's LR follows the batch linearly, AdamW's by its square root (Malladi et al., 2022)
            module.recipe = recipe.with_lr(lr * (new / batch if sgd else (new / batch) ** 0.5))
            if isinstance(module.hparams.get("recipe"), dict):  # what ran, for the checkpoint
                module.hparams.recipe = {**module.hparams.recipe, "lr": module.recipe.lr}
            else:
                module.hparams.lr = module.recipe.lr
        rule = f"lr x {new}/{batch}" if sgd else f"lr x sqrt({new}/{batch})"
        rank_zero_info(f"data: {n} training images give {n // (batch * world)} step(s) of batch {batch} an epoch; "
                       f"batch {new} gives {n // (new * world)}" + (f", at lr {module.recipe.lr:.3g} ({rule})"
                                                                    if lr is not None else ""))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.fit_to_data(trainer, pl_module, trainer.datamodule)
