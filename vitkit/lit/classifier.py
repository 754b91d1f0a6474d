"""Image classification with Lightning: the DeiT/Swin recipe around any vitkit preset."""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from timm.data.mixup import mixup_target
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torchmetrics.classification import MulticlassAccuracy

import vitkit

from .hparams import gather_rng_states, keep_own_hparams, restore_rng_states, seed_rank
from .optim import build_adamw, scaled_lambda, warmup_cosine
from .sharding import check_gradients_sync, data_parallel_mesh, shard

log = logging.getLogger(__name__)


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
        get_ema_multi_avg_fn(self.decay)([e for e, _ in floats], [m.detach() for _, m in floats], None)
        self.updates += 1

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)


class WarmupCosine:
    """The LR multiplier of an optimizer step: linear warmup over ``warmup_epochs``, then cosine down to
    ``min_lr_ratio`` at the last step; 1 until :meth:`set_length` gives the run's length."""

    def __init__(self, warmup_epochs: float, min_lr_ratio: float) -> None:
        self.warmup_epochs, self.min_lr_ratio = warmup_epochs, min_lr_ratio
        self.total: int | None = None
        self.warmup = 0

    def set_length(self, total: int, max_epochs: int | None) -> None:
        steps_per_epoch = total / max_epochs if max_epochs and max_epochs > 0 else total
        self.total = total
        self.warmup = min(total, max(1, round(self.warmup_epochs * steps_per_epoch))) if self.warmup_epochs > 0 else 0

    def __call__(self, step: int) -> float:
        return 1.0 if self.total is None else warmup_cosine(step, self.warmup, self.total, self.min_lr_ratio)


class ImageClassifier(L.LightningModule):
    """A vitkit preset trained with AdamW, warmup + cosine, label smoothing, mixup/cutmix and EMA.

    Every argument is serializable, so ``ImageClassifier.load_from_checkpoint(path)`` rebuilds the model
    with or without the CLI.

    Args:
        model_name: a preset from ``vitkit.list_models()``, or a pretrained name: a timm tag
            (``vit_base_patch16_224.augreg2_in21k_ft_in1k``) or torchvision weights
            (``ViT_B_16_Weights.IMAGENET1K_V1``), whose mean, std, crop and interpolation the data follows.
        pretrained: load that name's weights (from the Hugging Face or torch hub cache, downloaded only when
            missing); positions / windows are resampled to ``img_size`` and a new head is made for ``num_classes``.
        num_classes: classes of the data (linked from the data module by the CLI).
        img_size: input resolution (linked from the data module by the CLI); None keeps the preset's.
        model_overrides: any other config field of the preset, e.g. ``{"depth": 6, "drop_path_rate": 0.1}``.
        class_names: stored in the checkpoint for prediction (linked from the data module).
        lr: peak learning rate (for the whole batch; the configs scale it as lr_base x batch / 512).
        min_lr: floor of the cosine.
        warmup_epochs: linear warmup length, stepped per optimizer step.
        layer_decay: layer-wise LR decay (e.g. 0.65 for fine-tuning); None disables.
        label_smoothing, mixup, cutmix, mixup_prob, mixup_switch_prob: timm's Mixup / soft-target CE.
        ema_decay: keep an EMA of the weights, validated alongside (``val/top1_ema``); None disables.
        freeze_backbone: train only the head (linear probe).
        nonfinite_loss: what a NaN/Inf training loss does: ``stop`` ends the run with an error (the last
            good checkpoint stays as it was), ``skip`` drops that step on every rank and goes on (and
            still stops after 10 bad steps in a row).
        checkpoint: pretrained weights to start from (a file or folder of any format vitkit reads, see
            ``vitkit.checkpoints``), adapted as with ``pretrained``. Read when the module is built; resuming
            with ``--ckpt_path`` then replaces them with the run's own. A checkpoint this module writes holds
            every weight, so it records ``pretrained: false`` and no ``checkpoint``: ``load_from_checkpoint``
            reads nothing else.
        compile: run the model under ``torch.compile`` (compiled in place in ``configure_model``, so the
            state_dict and checkpoints keep the plain parameter names).
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        pretrained: bool = False,
        num_classes: int | None = None,
        img_size: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        lr: float = 5e-4,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        min_lr: float = 1e-5,
        warmup_epochs: float = 5.0,
        layer_decay: float | None = None,
        label_smoothing: float = 0.1,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        ema_decay: float | None = None,
        freeze_backbone: bool = False,
        checkpoint: str | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        keep_own_hparams(self)
        if vitkit.family(model_name) == "seq2seq":
            raise ValueError(f"{model_name!r} is an encoder-decoder preset; train it with "
                             "--model vitkit.lit.Seq2SeqModule (class_path: vitkit.lit.Seq2SeqModule in a config)")
        overrides = dict(model_overrides or {})
        if num_classes is not None:
            overrides["num_classes"] = num_classes
        if img_size is not None:
            overrides["img_size"] = img_size
        self.model = vitkit.create_model(model_name, pretrained=pretrained, checkpoint=checkpoint, **overrides)
        if getattr(self.model, "load_report", None) is not None:
            rank_zero_info(str(self.model.load_report))
        if freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith("head"))
        self.num_classes = self.model.cfg.num_classes
        self.ema = EMA(self.model, ema_decay) if ema_decay else None
        self.mixup = None
        if mixup > 0 or cutmix > 0:
            self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=mixup_prob,
                               switch_prob=mixup_switch_prob, label_smoothing=label_smoothing,
                               num_classes=self.num_classes)
        k5 = min(5, self.num_classes)
        self.metrics = nn.ModuleDict({
            f"{split}_{k}": MulticlassAccuracy(self.num_classes, top_k=t, average="micro")
            for split in ("val", "val_ema", "test") for k, t in (("top1", 1), ("top5", k5))
        })
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {nonfinite_loss!r}")
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss
        self._stepped = False  # whether a micro-batch of the coming optimizer step had a loss
        self._compiled = False
        self._rank_seeded = False

    def configure_model(self) -> None:
        if self._compiled:  # called again by every trainer.fit / test
            return
        self._compiled = True
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ModelParallelStrategy):  # FSDP2: every block, then the root; the EMA alike
            options = getattr(strategy, "block_options", {})
            mesh = data_parallel_mesh(self)
            shard(self.model, mesh, self.trainer.precision, **options)
            if self.ema is not None:
                shard(self.ema.module, mesh)
        elif self.hparams.compile:
            self.model.compile()  # in place: parameter names stay those of the plain model

    def on_fit_start(self) -> None:
        check_gradients_sync(self.trainer, self.model)

    def on_train_start(self) -> None:
        # The schedule's length is read here, not in configure_optimizers: asking Lightning for the number of
        # steps builds the training loader's iterator, which draws from the global generator; at set-up time a
        # sharded strategy has not yet restored a resumed run's generators, so that draw would not be the one
        # the uninterrupted run made.
        total = max(1, int(self.trainer.estimated_stepping_batches))
        self._schedule.set_length(total, self.trainer.max_epochs)
        sched = self.lr_schedulers()
        for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)  # the current step's LR, now that the length is known

    def setup(self, stage: str) -> None:
        if not self._rank_seeded:  # once: a later fit or test in the same process must not add it again
            seed_rank(self.trainer)  # before a resumed run restores every rank's own stream
            self._rank_seeded = True

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    # -- steps -------------------------------------------------------------------------------------

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        # A batch with no sample arrives empty: every file of it was unreadable (counted by the data module), or
        # a streaming rank had no batch left in the epoch. Such a rank adds no gradient; the step is skipped
        # only when no rank has a sample. Decided on all ranks together: a rank that skipped its backward
        # alone would leave the others waiting in the gradient all-reduce. One small all-reduce per step,
        # only when a skip can happen.
        loss = None if len(batch[1]) == 0 else self._loss(*batch)
        empty, nonfinite = loss is None, loss is not None and not bool(torch.isfinite(loss))
        all_empty = empty
        if self.trainer.world_size > 1 and self._may_skip:
            flags = torch.tensor([empty, nonfinite], dtype=torch.float32, device=self.device)
            n_empty, n_nonfinite = self.trainer.strategy.reduce(flags, reduce_op="sum").tolist()
            all_empty, nonfinite = n_empty == self.trainer.world_size, n_nonfinite > 0
        if nonfinite:
            value = "nan/inf on another rank" if loss is None or torch.isfinite(loss) else loss.item()
            self.bad_steps += 1
            if self.hparams.nonfinite_loss == "stop" or self.bad_steps > 10:
                raise FloatingPointError(
                    f"non-finite training loss ({value}) at global step {self.global_step}"
                    f"{f', {self.bad_steps} steps in a row' if self.bad_steps > 1 else ''}; the run stops here "
                    "and the last checkpoint written before this step is left as it was. Lower the lr, check "
                    "the data, or set model.nonfinite_loss=skip to drop such steps.")
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
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(batch[1]))
        return loss

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
        return self.hparams.nonfinite_loss == "skip" or getattr(datamodule, "may_yield_empty", False)

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        if self.mixup is not None:
            soft = self._mix(x, y)  # soft targets already carry the label smoothing; x is mixed in place
            return torch.sum(-soft * F.log_softmax(self(x).float(), dim=-1), dim=-1).mean()
        return F.cross_entropy(self(x).float(), y, label_smoothing=self.hparams.label_smoothing)

    def _mix(self, x: Tensor, y: Tensor) -> Tensor:
        """timm's Mixup/CutMix, which mixes a batch with its reverse and so takes even batches only. An odd batch
        (the last of an epoch, or one that lost an unreadable file) is mixed but for its last image, which keeps
        its own label-smoothed target."""
        n = len(x) - len(x) % 2
        soft = mixup_target(y, self.mixup.num_classes, smoothing=self.mixup.label_smoothing)
        if n:
            x[:n], soft[:n] = self.mixup(x[:n], y[:n])
        return soft

    def on_train_epoch_end(self) -> None:
        self._report_skipped("train")

    def on_validation_epoch_end(self) -> None:
        self._report_skipped("val")

    def on_test_epoch_end(self) -> None:
        self._report_skipped("test")

    def _report_skipped(self, split: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "report_skipped"):
            self.log(f"{split}/skipped_files", float(dm.report_skipped(split)))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None and self._stepped:  # once per optimizer step, never for a skipped one
            self.ema.update(self.model)
        self._stepped = False

    def _evaluate(self, batch: tuple[Tensor, Tensor], split: str) -> None:
        x, y = batch
        if len(y) == 0:  # every file of the batch was unreadable
            return
        logits = self(x)
        self.log(f"{split}/loss", F.cross_entropy(logits.float(), y), prog_bar=split == "val", sync_dist=True,
                 batch_size=x.shape[0])
        for k in ("top1", "top5"):
            self.metrics[f"{split}_{k}"](logits, y)
            self.log(f"{split}/{k}", self.metrics[f"{split}_{k}"], prog_bar=k == "top1", batch_size=x.shape[0])
        if split == "val" and self.ema is not None:
            ema_logits = self.ema(x)
            for k in ("top1", "top5"):
                self.metrics[f"val_ema_{k}"](ema_logits, y)
                self.log(f"val/{k}_ema", self.metrics[f"val_ema_{k}"], batch_size=x.shape[0])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).softmax(dim=-1)

    # -- exact resume ---------------------------------------------------------------------------------
    # Lightning restores weights, optimizer, schedule and loop counters; the random streams that decide
    # shuffling, augmentation, mixup and drop path are saved here too, one per rank, so a resumed run
    # draws what the uninterrupted run would have drawn.

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = gather_rng_states(self.trainer)  # every rank calls this hook
        hp = checkpoint.get("hyper_parameters")
        if hp is not None:  # the state dict holds every weight: rebuilding the module needs no other file
            hp.update(pretrained=False, checkpoint=None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # restored here, before the fit loop draws its first shuffle from the global generator; not when the
        # module is only loaded (load_from_checkpoint), which must leave the caller's generators alone
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            return
        if checkpoint.get("rng_states"):
            restore_rng_states(trainer, checkpoint["rng_states"])

    # -- optimisation ------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        opt = build_adamw(self.model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.layer_decay)
        self._schedule = WarmupCosine(hp.warmup_epochs, hp.min_lr / hp.lr)  # its length is set in on_train_start
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, scaled_lambda(self._schedule, [g["lr_scale"] for g in opt.param_groups]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
