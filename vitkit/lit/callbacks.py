"""Callbacks: checkpointing that never loses work (last.ckpt always current, atomic writes), and the
training-curves picture drawn at the end of fit."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from weakref import proxy

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ModelCheckpoint with two guarantees added.

    * ``last.ckpt`` follows every validation and the end of fit, also when the monitored metric did
      not improve (Lightning only refreshes it when a top-k file was written) and when a run stops by
      ``max_steps`` in mid-epoch; ``--ckpt_path last`` then resumes from the true latest state.
    * Every file is written to ``<name>.tmp`` and renamed over the target, so a process killed during a
      save leaves the previous checkpoint intact, never a torn one.

    Unlike Lightning's default, a new run in the same folder replaces ``last.ckpt`` (and a best file of
    the same name) instead of adding ``last-v1.ckpt``, so ``last.ckpt`` is always the newest run's.
    """

    def __init__(self, *args, enable_version_counter: bool = False, **kwargs) -> None:
        super().__init__(*args, enable_version_counter=enable_version_counter, **kwargs)

    def _refresh_last(self, trainer: L.Trainer) -> None:
        if (self.save_last and not trainer.fast_dev_run and not trainer.sanity_checking
                and trainer.state.fn == TrainerFn.FITTING and self._last_global_step_saved != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run:  # Lightning would still write last.ckpt here; a dry run writes nothing
            return
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        tmp = f"{filepath}.tmp"
        trainer.save_checkpoint(tmp, self.save_weights_only)
        if trainer.is_global_zero:
            os.replace(tmp, filepath)  # atomic on POSIX: readers see the old file or the new one
        trainer.strategy.barrier("vitkit_checkpoint_rename")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


class TrainingCurves(Callback):
    """At the end of ``fit``, draws loss, accuracy and learning rate from the CSV log into
    ``curves.png`` beside ``metrics.csv`` (rank 0 only; nothing without a CSVLogger)."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.fast_dev_run:
            return
        from vitkit.plots import training_curves

        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()  # flush rows still buffered
                metrics = Path(logger.log_dir) / "metrics.csv"
                if metrics.exists():
                    log.info("training curves: %s", training_curves(metrics))
