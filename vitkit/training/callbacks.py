"""Checkpoints that never lose work, the training-curves picture drawn at the end of fit, and the model summary.

* :class:`AtomicCheckpointIO` is the checkpoint writer (a Lightning ``CheckpointIO`` plugin): every
  file is written beside its target and renamed over it, so a process killed during a save leaves the
  previous checkpoint whole.
* :class:`ModelCheckpoint` is Lightning's, with its files under the run's ``default_root_dir``,
  ``last.ckpt`` refreshed after every validation and at the end of fit, and a refusal to start a new
  run over another run's ``last.ckpt``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, RichModelSummary
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from vitkit.errors import ExistingFileError, UsageTypeError

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into ``<file>.tmp`` in the same folder, flushed to disk, then renamed over ``<file>``.

    The rename is atomic on POSIX file systems: a reader (or a resumed run) sees the old checkpoint or
    the new one, never a torn file. Remote paths (``s3://`` ...) go through Lightning's writer unchanged,
    since object stores replace whole objects anyway."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise UsageTypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def checkpoints_dir(trainer: L.Trainer) -> str:
    """Where a run's checkpoints go unless a callback names its own ``dirpath``."""
    return os.path.join(trainer.default_root_dir, "checkpoints")


PROBE_FILE = "probe.ckpt"


def probe_path(trainer: L.Trainer) -> Path:
    """Where a run saves the probe it starts from (``head_init="probe"``): beside its checkpoints."""
    folder = getattr(trainer.checkpoint_callback, "dirpath", None) or checkpoints_dir(trainer)
    return Path(folder) / PROBE_FILE


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ModelCheckpoint, keeping one resumable run per ``default_root_dir``.

    * ``dirpath`` defaults to ``<trainer.default_root_dir>/checkpoints`` (Lightning's default moves into a
      new logger version folder each run, where ``--ckpt_path last`` could never find it).
    * ``last.ckpt`` follows every validation and the end of fit, also when the monitored metric did not
      improve (Lightning only refreshes it when a top-k file was written) and when a run stops by
      ``max_steps`` in mid-epoch; ``--ckpt_path last`` then resumes from the true latest state.
    * A new ``fit`` into a folder that already holds a ``last.ckpt`` is refused before the first step,
      unless it resumes (``ckpt_path``): another run's resumable state is never replaced by accident.
    * ``last_every_n_train_steps`` refreshes ``last.ckpt`` (and nothing else) every N optimizer steps, so a long
      epoch can be resumed from mid-epoch: with a streaming data module, at the very next batch. Lightning's
      ``every_n_train_steps`` refreshes it too, as Lightning's own ``save_last`` does.
    * No ``-v1`` version counter: the best and last files keep their names.
    * A run ends with one line: the best monitored score, its epoch and its file (or the last file, unmonitored).

    Atomic writes come from the trainer's checkpoint writer: the vitkit CLI installs
    :class:`AtomicCheckpointIO` (pass it in ``Trainer(plugins=[...])`` when you build a Trainer yourself).
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, *args, save_last: bool = True,
                 enable_version_counter: bool = False, last_every_n_train_steps: int = 0, **kwargs) -> None:
        super().__init__(dirpath, *args, save_last=False, enable_version_counter=enable_version_counter, **kwargs)
        self.keep_last = save_last  # written here, in the callback hooks below, instead of by Lightning
        self.after_epoch = kwargs.get("save_on_train_epoch_end")
        self.last_every = [n for n in (last_every_n_train_steps, kwargs.get("every_n_train_steps")) if n and n > 0]
        self._last_written_step = -1
        self.best_epoch: int | None = None  # the epoch whose checkpoint is best_model_path

    def _note_best(self, trainer: L.Trainer, before: str) -> None:
        if self.best_model_path and self.best_model_path != before:
            self.best_epoch = trainer.current_epoch

    def state_dict(self) -> dict:
        return {**super().state_dict(), "best_epoch": self.best_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.best_epoch = state_dict.pop("best_epoch", None)
        super().load_state_dict(state_dict)

    def summary(self, probe: tuple[float, str] | None = None) -> str:
        """The run's result in one line: the best monitored score, its epoch and file (or the last file); beside
        it, the probe on frozen features a run started from (``head_init="probe"``)."""
        if self.monitor and self.best_model_score is not None:
            epoch = f" at epoch {self.best_epoch}" if self.best_epoch is not None else ""
            line = f"best {self.monitor} {float(self.best_model_score):.4f}{epoch}: {self.best_model_path}"
            if probe is not None and self.best_model_path == probe[1]:
                return f"{line} (the probe on frozen features; training did not beat it)"
            return line + (f" (the probe on frozen features: {probe[0]:.4f})" if probe is not None else "")
        return f"last checkpoint: {self.last_model_path or self.last_path}"

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        probe = getattr(pl_module, "probe_baseline", None)
        probe = (probe, getattr(pl_module, "probe_file", "")) \
            if probe is not None and self.monitor in ("val/top1", "val/mAP", "val/mIoU") else None
        if probe is not None and (self.best_model_score is None or probe[0] >= float(self.best_model_score)):
            self.best_model_path, self.best_model_score, self.best_epoch = probe[1], torch.tensor(probe[0]), None
        if trainer.is_global_zero and not trainer.fast_dev_run:
            rank_zero_info(self.summary(probe))

    @property
    def last_path(self) -> str:
        return os.path.join(self.dirpath, f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}")

    def resolve_dirpath(self, trainer: L.Trainer) -> None:
        """Fix ``dirpath`` to ``<default_root_dir>/checkpoints`` unless one was given."""
        if self.dirpath is None:
            self.dirpath = checkpoints_dir(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.resolve_dirpath(trainer)
        if self.monitor == "val/top1" and getattr(pl_module, "multi_label", False):  # a classifier recipe's
            self.monitor = "val/mAP"
            self.filename = (self.filename or "").replace("val/top1", "val/mAP") or None
            rank_zero_info("checkpoints: several labels per image, so the best checkpoint is kept by val/mAP "
                           "(the recipe names val/top1)")
        super().setup(trainer, pl_module, stage)

    def check_fresh(self, trainer: L.Trainer, ckpt_path: str | None) -> None:
        """Refuse a new fit (``ckpt_path`` None) into a folder that already holds another run's last.ckpt."""
        self.resolve_dirpath(trainer)
        if self.keep_last and not trainer.fast_dev_run and ckpt_path is None and os.path.exists(self.last_path):
            raise ExistingFileError(
                f"{self.last_path} belongs to an earlier run in {trainer.default_root_dir!r}; a new run there "
                "would replace it. Resume that run with --ckpt_path last, or start this one elsewhere with "
                "--trainer.default_root_dir DIR (or delete the folder).")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # here, not in setup: Lightning records the checkpoint it resumes from only after setup (the CLI
        # checks earlier still, before anything is written)
        self.check_fresh(trainer, trainer.ckpt_path)
        super().on_train_start(trainer, pl_module)

    def _write_last(self, trainer: L.Trainer) -> None:
        if (not self.keep_last or trainer.fast_dev_run or trainer.sanity_checking
                or trainer.state.fn != TrainerFn.FITTING or self._last_written_step == trainer.global_step):
            return
        trainer.save_checkpoint(self.last_path, self.save_weights_only)  # every rank: it ends in a barrier
        self._last_written_step = trainer.global_step
        self.last_model_path = self.last_path

    # last.ckpt is written where Lightning writes its own checkpoints: after the epoch when validation ends
    # the epoch (so a resumed run starts the next epoch), after validation when it runs mid-epoch.

    def saves_after_epoch(self, trainer: L.Trainer) -> bool:
        """Whether checkpoints are written at the end of the training epoch rather than after validation:
        Lightning's rule (``save_on_train_epoch_end``, else after the epoch when validation runs once per epoch
        at its end, or not at all), from the trainer's public settings."""
        if self.after_epoch is not None:
            return self.after_epoch
        if trainer.check_val_every_n_epoch != 1:
            return False
        val_batches = trainer.num_val_batches
        if (sum(val_batches) if isinstance(val_batches, list) else val_batches) == 0:
            return True
        return trainer.val_check_interval == 1.0

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        before = self.best_model_path
        super().on_validation_end(trainer, pl_module)
        self._note_best(trainer, before)
        if not self.saves_after_epoch(trainer):
            self._write_last(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if any(trainer.global_step % n == 0 for n in self.last_every):
            self._write_last(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        before = self.best_model_path
        super().on_train_epoch_end(trainer, pl_module)
        self._note_best(trainer, before)
        if self.saves_after_epoch(trainer):
            self._write_last(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._write_last(trainer)


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger, under the run's folder by default.

    ``save_dir`` may be left out: the vitkit CLI then puts the log under the run's ``default_root_dir``
    (``<root>/logs/version_N/metrics.csv``), so a config names no paths."""

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "logs", **kwargs) -> None:
        super().__init__(os.getcwd() if save_dir is None else save_dir, name=name, **kwargs)


class TrainingCurves(Callback):
    """Draws curves.png at the end of ``fit``.

    Loss, accuracy and learning rate from the CSV log, into ``curves.png`` beside ``metrics.csv`` (rank 0 only; nothing
    without a CSVLogger)."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.fast_dev_run:
            return
        from vitkit.evaluation.plots import training_curves

        for logger in trainer.loggers:
            if isinstance(logger, _LightningCSVLogger):
                logger.save()  # flush rows still buffered
                metrics = Path(logger.log_dir) / "metrics.csv"
                if metrics.exists():
                    log.info("training curves: %s", training_curves(metrics))


class ModelSummary(RichModelSummary):
    """Lightning's model summary at the start of fit, without its FLOPs column where Lightning counted none: it counts
    them only from a module's ``example_input_array``, and shows 0 for every module without one. ``vitkit bench``
    and ``vitkit models`` give a model's GMACs."""

    def on_fit_start(self, trainer, pl_module) -> None:
        ema = getattr(pl_module, "ema", None)  # the weights' average: a copy of the model, counted apart from frozen
        self._summarize_kwargs["averaged"] = sum(p.numel() for p in ema.parameters()) \
            if isinstance(ema, torch.nn.Module) else 0
        super().on_fit_start(trainer, pl_module)

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        averaged = kwargs.pop("averaged", 0)
        if total_flops:
            return RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                              total_training_modes, total_flops, **kwargs)
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name or " ", justify="right" if name in ("Params", "Params per Device") else "left")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        count = lambda n: get_human_readable_count(int(n)).strip()  # noqa: E731
        frozen, size = count(total_parameters - trainable_parameters - averaged), get_formatted_model_size(model_size)
        kept = f", {count(averaged)} in the weights' average (EMA)" if averaged else ""
        console.print(f"[bold]Params[/]: {count(trainable_parameters)} trainable, {frozen} frozen{kept} ({size} MB)")
