"""What every vitkit training module carries, in one place: sharding or compiling the model in ``configure_model``,
the refusal of unsynchronised ranks, per-rank random streams saved for an exact resume, the learning-rate schedule
stepped per optimizer step, an EMA of the weights, and a non-finite loss that stops the run or is skipped on every
rank together. :class:`~vitkit.lit.ImageClassifier`, :class:`~vitkit.lit.Seq2SeqModule` and
:class:`~vitkit.lit.MaskedImageModeling` derive from :class:`TrainingModule` and add their loss and metrics.

A subclass saves its hyper-parameters (:meth:`keep_arguments`), sets ``self.recipe`` (its ``recipe`` argument, a
:class:`~vitkit.training.recipe.Recipe`: optimizer, schedule, non-finite steps, compile) and ``self.model`` (and
``self.ema`` with :meth:`make_ema`), and implements :meth:`step_loss`. Its ``FLAT`` names the flat arguments it
took before its typed parts (``lr``, ``freeze_backbone``, ...): a checkpoint of them is refused by
:meth:`load_from_checkpoint` in one line, and ``vitkit convert`` upgrades it.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torchmetrics import MeanMetric

from vitkit.checkpoints.adapters import require_backbone
from vitkit.errors import UsageError

from .flat import Flat, refuse_flat_checkpoint
from .hparams import gather_rng_states, keep_own_hparams, read_hparams, restore_rng_states, seed_rank
from .recipe import Recipe, WarmupSchedule
from .sharding import check_gradients_sync, data_parallel_mesh, shard

log = logging.getLogger(__name__)
_LOADING = contextvars.ContextVar("vitkit_loading_checkpoint", default=False)


def loading_checkpoint() -> bool:
    """Whether a module is being built by ``load_from_checkpoint`` (to use its weights), not for a run."""
    return _LOADING.get()


class EMA(nn.Module):
    """Exponential moving average of a model's weights (Polyak averaging, as in DeiT's model EMA)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        # optimizer steps averaged in; not saved, so checkpoints keep the keys they always had
        self.register_buffer("updates", torch.zeros((), dtype=torch.long), persistent=False)

    def train(self, mode: bool = True) -> EMA:
        """The average is always evaluated as an inference model: its dropout and drop path stay off."""
        super().train(mode)
        self.module.eval()
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema = list(self.module.state_dict().values())
        live = list(model.state_dict().values())
        floats = [(e, m) for e, m in zip(ema, live, strict=True) if e.is_floating_point()]
        for sharded in (False, True):  # one kernel per kind: FSDP2 shards parameters but leaves buffers (BatchNorm's)
            pairs = [(e, m) for e, m in floats if isinstance(e, DTensor) == sharded]
            if pairs:
                get_ema_multi_avg_fn(self.decay)([e for e, _ in pairs], [m.detach() for _, m in pairs], None)
        self.updates += 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def swap_ema(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the ``model.`` and ``ema.module.`` entries exchanged (its own inverse)."""
    out = {}
    for key, value in state.items():
        if key.startswith("model."):
            key = "ema.module." + key.removeprefix("model.")
        elif key.startswith("ema.module."):
            key = "model." + key.removeprefix("ema.module.")
        out[key] = value
    return out


class TrainingModule(L.LightningModule):
    """The training machinery the vitkit modules share (see the module docstring)."""

    model: nn.Module
    recipe: Recipe  # set by the subclass from its own arguments
    FLAT: ClassVar[Flat | None] = None  # the subclass's flat arguments before its typed parts (``flat.py``)

    def __init__(self) -> None:
        super().__init__()
        self.ema: EMA | None = None  # an attribute, not a class default: nn.Module keeps submodules apart
        self.ema_is_model = False
        # the epoch's loss, weighted by each batch's samples; its own NaN check would read the loss back every step
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss
        self._first_nonfinite: Tensor | None = None  # (global step, loss) of the first non-finite loss, on the device
        self._stepped = False  # whether a micro-batch of the coming optimizer step had a loss
        self._configured = False
        self._rank_seeded = False

    def make_ema(self, decay: float | None, is_model: bool = False) -> None:
        """An EMA of ``self.model`` (``decay`` per optimizer step; None: none). With ``is_model`` the average is
        the run's model: what evaluation (``eval()`` mode) runs and what the checkpoint holds as ``model.``; the
        weights being trained ride in its ``ema.module.`` entries, put back where they were when a run resumes."""
        if is_model and not decay:
            raise UsageError("ema_is_model validates and saves the EMA of the weights; give ema_decay too (e.g. 0.9)")
        if decay and not 0 < decay < 1:
            raise UsageError(f"ema_decay must be in (0, 1) (the weight kept of the average at each step; null: no "
                             f"EMA), got {decay!r}")
        self.ema = EMA(self.model, decay) if decay else None
        self.ema_is_model = is_model

    def evaluated(self) -> nn.Module:
        """The model that evaluation runs: the EMA where it is the run's model, and not in training mode."""
        return self.ema.module if self.ema_is_model and self.ema is not None and not self.training else self.model

    @torch.no_grad()
    def restart_ema(self) -> None:
        """The EMA from the model as it is now: after a change made before the first step (a head fitted by the
        probe), which an average begun at construction would only take in step by step."""
        if self.ema is not None:
            self.ema.module.load_state_dict(self.model.state_dict())

    def keep_probe(self, score: float, name: str, what: str) -> None:
        """A head fitted by the probe before the first step: the EMA restarted from it, its validation ``score``
        (by the metric ``name``) logged as ``val/probe_baseline``, the model saved as ``probe.ckpt`` and said in a
        line with ``what`` it was fitted on."""
        from .callbacks import probe_path

        self.probe_baseline = score
        self.restart_ema()
        for logger in self.trainer.loggers:
            logger.log_metrics({"val/probe_baseline": score}, step=0)
        path = probe_path(self.trainer)
        self.trainer.save_checkpoint(path, weights_only=True)  # the model at step 0: no optimizer state yet
        self.probe_file = str(path)
        rank_zero_info(f"probe: a logistic regression on the frozen features of {what}, {name} {score:.4f} "
                       f"(val/probe_baseline): {path}")

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> TrainingModule:
        """Lightning's, with a clear line for a checkpoint it cannot rebuild: one of the flat arguments of before the
        parts (``vitkit convert`` upgrades it), or one whose backbone file is gone."""
        hp = read_hparams(checkpoint_path)
        require_backbone(hp, checkpoint_path)  # named by a file that holds only what trained (adapters, head)
        refuse_flat_checkpoint(checkpoint_path, hp, cls.FLAT)
        token = _LOADING.set(True)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            _LOADING.reset(token)

    def use_recipe(self, recipe: Recipe | dict[str, Any]) -> None:
        """``self.recipe`` from the module's ``recipe`` argument (a :class:`Recipe`, or its fields as a checkpoint
        keeps them), in the hyper-parameters as plain values: the checkpoint loads with ``weights_only``."""
        self.recipe = recipe if isinstance(recipe, Recipe) else Recipe(**recipe)
        self.hparams.recipe = dataclasses.asdict(self.recipe)

    def keep_arguments(self) -> None:
        """The first line of every module's ``__init__``: its arguments saved as hyper-parameters (the caller's own
        only: the CLI links foreign ones in)."""
        self.save_hyperparameters(frame=inspect.currentframe().f_back)
        keep_own_hparams(self)

    # -- what a subclass gives ---------------------------------------------------------------------------------

    def step_loss(self, batch: Any) -> Tensor:
        """The training loss of a batch that holds at least one sample."""
        raise NotImplementedError

    def batch_size(self, batch: Any) -> int:
        """Samples in a batch (0: every file of it was unreadable, or a streaming rank ran out)."""
        return len(batch[1])

    def lr_multiplier(self) -> Callable[[int], float]:
        """The schedule: a function of the optimizer step; the recipe's warmup, then its decay, whose length is set
        at ``on_train_start``."""
        return self.recipe.multiplier()

    def adapter_lr_scale(self) -> float:
        """The LR of LoRA adapters over the recipe's (1: a module without them)."""
        return 1.0

    def data_cfg(self):
        """The data module's preprocessing (mean, std, sizes), or None outside a trainer or without one."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(dm, "data_cfg", None)

    # -- set-up ------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self._configured:  # called again by every trainer.fit / test
            return
        self._configured = True
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ModelParallelStrategy):  # FSDP2: every block, then the root; the EMA alike
            options = getattr(strategy, "block_options", {})
            mesh = data_parallel_mesh(self)
            shard(self.model, mesh, self.trainer.precision, **options)
            if self.ema is not None:
                shard(self.ema.module, mesh)
        elif self.recipe.compile:
            self.model.compile()  # in place: parameter names stay those of the plain model

    def on_fit_start(self) -> None:
        check_gradients_sync(self.trainer, self.model)

    def setup(self, stage: str) -> None:
        if not self._rank_seeded:  # once: a later fit or test in the same process must not add it again
            seed_rank(self.trainer)  # before a resumed run restores every rank's own stream
            self._rank_seeded = True

    def on_train_start(self) -> None:
        # The schedule's length is read here, not in configure_optimizers: asking Lightning for the number of
        # steps builds the training loader's iterator, which draws from the global generator; at set-up time a
        # sharded strategy has not yet restored a resumed run's generators, so that draw would not be the one
        # the uninterrupted run made.
        sched = self.lr_schedulers()
        schedule = getattr(sched, "schedule", None)
        if not isinstance(schedule, WarmupSchedule) or not schedule.needs_length:  # 1/sqrt(step) after its warmup
            return
        total = self.trainer.estimated_stepping_batches
        if not 0 < total < float("inf"):  # a stream's epoch has no length before it is read
            raise UsageError("the training data is a stream, whose length the LR schedule cannot know: give "
                             "--trainer.max_steps N, the optimizer steps of the whole run (the warmup then takes "
                             "warmup_epochs x N / max_epochs of them)")
        sched.schedule.set_length(max(1, int(total)), self.trainer.max_epochs)
        for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)  # the current step's LR, now that the length is known

    def held_back(self) -> Callable[[str], bool] | None:
        """Which of ``model``'s parameter names ``recipe.head_epochs`` holds still while the head alone learns
        (None: the module has no such split)."""
        return None

    def configure_optimizers(self) -> dict:
        held = self.held_back() if self.recipe.head_epochs > 0 else None
        if self.recipe.head_epochs > 0 and held is None:
            raise UsageError(f"{type(self).__name__} takes no recipe.head_epochs (a head trained alone first is for "
                             "the detection and depth tasks; a classifier or segmenter fits its probe with "
                             f"--model.adaptation.head_init probe), got {self.recipe.head_epochs!r}")
        opt, sched = self.run_recipe().build(self.model, None if self._may_fuse() else False, self.lr_multiplier(),
                                             self.adapter_lr_scale(), held)  # min_lr / lr as the recipe's
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def run_recipe(self) -> Recipe:
        """The recipe at this run's total batch (devices x nodes x the data's batch x accumulated batches), its LR
        scaled from ``recipe.lr_batch``, in one line at the start of the run."""
        recipe, trainer = self.recipe, self._trainer
        batch = getattr(getattr(trainer, "datamodule", None), "hparams", {}).get("batch_size") if trainer else None
        if recipe.lr_batch is None:
            return recipe
        if not batch:
            log.warning("recipe.lr_batch %d: the data module names no batch_size, so the lr stays %.3g",
                        recipe.lr_batch, recipe.lr)
            return recipe
        devices, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        total = devices * batch * accumulate
        scaled = recipe.for_batch(total)
        rule = f"x {total}/{recipe.lr_batch}" if recipe.lr_scaling == "linear" else \
            f"x sqrt({total}/{recipe.lr_batch})"
        rank_zero_info(f"lr: {recipe.lr:.3g} for a total batch of {recipe.lr_batch}; this run's is {total} ({devices} "
                       f"process(es) x batch {batch} x {accumulate} accumulated): lr {scaled.lr:.3g} ({rule})")
        return scaled

    def _may_fuse(self) -> bool:
        """Whether AdamW may be the fused kernel. Not under a gradient scaler (fp16 on GPUs), which must unscale the
        gradients before the step that a fused optimizer unscales in; not with gradient clipping under Lightning's
        mixed precision, which refuses such an optimizer then (it cannot tell whether a scaler is at work)."""
        if self._trainer is None:
            return True
        plugin = self.trainer.precision_plugin
        clipped = bool(self.trainer.gradient_clip_val)
        return getattr(plugin, "scaler", None) is None and not (clipped and isinstance(plugin, MixedPrecision))

    # -- a training step, skipped on every rank together when it must be ---------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # A batch with no sample arrives empty: every file of it was unreadable (counted by the data module), or
        # a streaming rank had no batch left in the epoch. Such a rank adds no gradient; the step is skipped only
        # when no rank has a sample. Decided on all ranks together: a rank that skipped its backward alone would
        # leave the others waiting in the gradient all-reduce. One small all-reduce per step, only when a skip
        # can happen.
        n = self.batch_size(batch)
        loss = None if n == 0 else self.step_loss(batch)
        if not self._decides_each_step:  # one process that stops on a non-finite loss: nothing read back here
            self._note_nonfinite(loss)
            self._stepped = True
            self.log_train_loss(loss, n)
            return loss
        empty, nonfinite = loss is None, loss is not None and not bool(torch.isfinite(loss))
        all_empty = empty
        if self.trainer.world_size > 1 and self._may_skip:
            flags = torch.tensor([empty, nonfinite], dtype=torch.float32, device=self.device)
            n_empty, n_nonfinite = self.trainer.strategy.reduce(flags, reduce_op="sum").tolist()
            all_empty, nonfinite = n_empty == self.trainer.world_size, n_nonfinite > 0
        if nonfinite:
            value = "nan/inf on another rank" if loss is None or torch.isfinite(loss) else loss.item()
            self.bad_steps += 1
            if self.recipe.nonfinite_loss == "stop" or self.bad_steps > 10:
                raise self._nonfinite_error(value, self.global_step, self.bad_steps)
            log.warning("skipping step %d: non-finite training loss %s", self.global_step, value)
            self.log("train/skipped_steps", float(self.bad_steps), on_step=True)
            return self._no_update_loss()
        if all_empty:
            log.warning("skipping step %d: no rank has a readable image in its batch", self.global_step)
            return self._no_update_loss()
        self.bad_steps = 0
        self._stepped = True  # on every rank, so that each applies the same all-reduced gradient
        if empty:
            log.debug("step %d: no sample in this rank's batch; the other ranks' samples make the step",
                      self.global_step)
            return self._no_update_loss()
        self.log_train_loss(loss, n)
        return loss

    @property
    def _decides_each_step(self) -> bool:
        """Whether a step must know on the host, before its backward, that it is to be skipped: when non-finite
        losses are skipped, or when a rank's batch can be empty (then every step asks the other ranks). Otherwise
        a non-finite loss stops the run, and :meth:`_note_nonfinite` keeps it on the device until the next
        logging step, epoch end or checkpoint, so that a step reads nothing back from an accelerator."""
        return self.recipe.nonfinite_loss == "skip" or self._may_skip or self.trainer.world_size > 1

    def _note_nonfinite(self, loss: Tensor) -> None:
        here = torch.stack([loss.new_full((), float(self.global_step), dtype=torch.float32), loss.detach().float()])
        if self._first_nonfinite is None:
            self._first_nonfinite = torch.full_like(here, float("inf"))
        seen = torch.isfinite(self._first_nonfinite[0])
        self._first_nonfinite = torch.where(seen | torch.isfinite(here[1]), self._first_nonfinite, here)

    def raise_if_nonfinite(self) -> None:
        """Stop the run if a step since the last check had a non-finite loss (one read from the device)."""
        if self._first_nonfinite is None:
            return
        step, value = self._first_nonfinite.tolist()
        if step != float("inf"):
            raise self._nonfinite_error(value, int(step), 1)

    @staticmethod
    def _nonfinite_error(value: Any, step: int, in_a_row: int) -> FloatingPointError:
        return FloatingPointError(
            f"non-finite training loss ({value}) at global step {step}"
            f"{f', {in_a_row} steps in a row' if in_a_row > 1 else ''}; the run stops here and the last checkpoint "
            "written before this step is left as it was. Lower the lr, check the data, or set "
            "model.nonfinite_loss=skip to drop such steps.")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (self.global_step + 1) % max(1, self.trainer.log_every_n_steps) == 0:
            self.raise_if_nonfinite()

    def log_train_loss(self, loss: Tensor, n: int) -> None:
        """``train/loss_step``: this rank's loss, shown in the progress bar, at the trainer's logging steps (the
        progress bar reads a logged value back to the host). ``train/loss_epoch``: the mean over every rank's
        samples of the epoch, synchronised once at its end (``on_train_epoch_end``), so that a rank whose batch was
        empty, and so logs nothing in that step, never leaves the others waiting in a collective."""
        if self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            self.log("train/loss_step", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=n)
        self.train_loss.update(loss.detach().float(), n)

    def on_train_epoch_end(self) -> None:
        self.raise_if_nonfinite()
        self.log("train/loss_epoch", self.train_loss.compute())  # a collective: every rank calls this hook
        self.train_loss.reset()

    def _no_update_loss(self) -> Tensor:
        """A zero loss over every trainable weight, for a skipped step. Lightning cannot skip a step under DDP
        (returning None there is an error), so the backward runs on every rank, DDP's gradient all-reduce
        with it, and ``on_before_optimizer_step`` then drops the update."""
        return sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._stepped:  # no micro-batch of this step had a loss: no gradient, so AdamW leaves every weight
            optimizer.zero_grad(set_to_none=True)

    @property
    def _may_skip(self) -> bool:
        """Whether any rank could skip a step: its data can yield empty batches, or NaN steps are skipped."""
        datamodule = getattr(self.trainer, "datamodule", None)
        return self.recipe.nonfinite_loss == "skip" or getattr(datamodule, "may_yield_empty", False)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)  # the training steps of its micro-batches run in here
        if self._stepped:  # once per optimizer step, never for a skipped one
            self.after_optimizer_step()
        self._stepped = False

    def after_optimizer_step(self) -> None:
        """What follows every optimizer step taken (never a skipped one): the EMA's update."""
        if self.ema is not None:
            self.ema.update(self.model)

    # -- exact resume ------------------------------------------------------------------------------------------
    # Lightning restores weights, optimizer, schedule and loop counters; the random streams that decide
    # shuffling, augmentation, mixup, masks and drop path are saved here too, one per rank, so a resumed run
    # draws what the uninterrupted run would have drawn.

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.trainer.state.fn == "fit":  # never a checkpoint of weights a non-finite step has touched
            self.raise_if_nonfinite()
        checkpoint["rng_states"] = gather_rng_states(self.trainer)  # every rank calls this hook
        hp = checkpoint.get("hyper_parameters")
        if hp is not None and "checkpoint" in hp:  # the state dict holds every weight: no other file to read
            hp.update(pretrained=False, checkpoint=None)
        if self.ema_is_model and "state_dict" in checkpoint:  # the file's model is the average (make_ema)
            checkpoint["state_dict"] = swap_ema(checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ema_is_model and "state_dict" in checkpoint:
            state = checkpoint["state_dict"]
            if loading_checkpoint():  # to be used: `.model` is the average the run validated, kept and exported, and
                # so is the EMA; the weights being trained stay in the file, for a run that resumes from it
                checkpoint["state_dict"] = {**state, **{"ema.module." + k.removeprefix("model."): v
                                                        for k, v in state.items() if k.startswith("model.")}}
            else:  # a run resuming: the weights being trained back into the model, the average into the EMA
                checkpoint["state_dict"] = swap_ema(state)
        # restored here, before the fit loop draws its first shuffle from the global generator; not when the
        # module is only loaded (load_from_checkpoint), which must leave the caller's generators alone
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            return
        if checkpoint.get("rng_states"):
            restore_rng_states(trainer, checkpoint["rng_states"])
