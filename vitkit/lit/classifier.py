"""Image classification with Lightning: the DeiT/Swin recipe around any vitkit preset."""

from __future__ import annotations

import copy
import logging
import random
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from timm.data import Mixup
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

import vitkit

from .optim import build_adamw, scaled_lambda, warmup_cosine

log = logging.getLogger(__name__)


class EMA(nn.Module):
    """Exponential moving average of a model's weights (Polyak averaging, as in DeiT's model EMA)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

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
        torch._foreach_lerp_([e for e, _ in floats], [m.detach() for _, m in floats], 1.0 - self.decay)

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)


class ImageClassifier(L.LightningModule):
    """A vitkit preset trained with AdamW, warmup + cosine, label smoothing, mixup/cutmix and EMA.

    Every argument is serializable, so ``ImageClassifier.load_from_checkpoint(path)`` rebuilds the model
    with or without the CLI.

    Args:
        model_name: a preset from ``vitkit.list_models()``.
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
            ``vitkit.checkpoints``); positions / windows are resampled to ``img_size`` and a new head is
            made for ``num_classes``. Read when the module is built; resuming with ``--ckpt_path`` then
            replaces them with the run's own, and ``load_from_checkpoint(path, checkpoint=None)`` skips it.
        compile: run the model under ``torch.compile``.
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
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
        overrides = dict(model_overrides or {})
        if num_classes is not None:
            overrides["num_classes"] = num_classes
        if img_size is not None:
            overrides["img_size"] = img_size
        self.model = vitkit.create_model(model_name, checkpoint=checkpoint, **overrides)
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
        self._compiled = torch.compile(self.model) if compile else None
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {nonfinite_loss!r}")
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss

    def forward(self, x: Tensor) -> Tensor:
        return (self._compiled or self.model)(x)

    # -- steps -------------------------------------------------------------------------------------

    def training_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> Tensor | None:
        if batch is None:  # every file of the batch was unreadable (counted by the data module)
            return None
        x, y = batch
        if self.mixup is not None:
            x, soft = self.mixup(x, y)  # soft targets already carry the label smoothing
            loss = torch.sum(-soft * F.log_softmax(self(x).float(), dim=-1), dim=-1).mean()
        else:
            loss = F.cross_entropy(self(x).float(), y, label_smoothing=self.hparams.label_smoothing)
        bad = not bool(torch.isfinite(loss))
        if self.hparams.nonfinite_loss == "skip":
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)  # one rank bad: all skip
        if bad:
            self.bad_steps += 1
            if self.hparams.nonfinite_loss == "stop" or self.bad_steps > 10:
                raise FloatingPointError(
                    f"non-finite training loss ({loss.item()}) at global step {self.global_step}"
                    f"{f', {self.bad_steps} steps in a row' if self.bad_steps > 1 else ''}; the run stops here "
                    "and the last checkpoint written before this step is left as it was. Lower the lr, check "
                    "the data, or set model.nonfinite_loss=skip to drop such steps.")
            log.warning("skipping step %d: non-finite training loss %s", self.global_step, loss.item())
            self.log("train/skipped_steps", float(self.bad_steps), on_step=True)
            return None
        self.bad_steps = 0
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=x.shape[0])
        return loss

    def on_train_epoch_end(self) -> None:
        self._report_skipped("train")

    def on_validation_epoch_end(self) -> None:
        self._report_skipped("val")

    def _report_skipped(self, split: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "report_skipped"):
            self.log(f"{split}/skipped_files", float(dm.report_skipped(split)))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            self.ema.update(self.model)

    def _evaluate(self, batch: tuple[Tensor, Tensor] | None, split: str) -> None:
        if batch is None:
            return
        x, y = batch
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
    # shuffling, augmentation, mixup and drop path are saved here too, so a resumed run draws what the
    # uninterrupted run would have drawn.

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["rng_states"] = {  # plain tensors and ints, so weights_only loading accepts them
            "torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # restored here, before the fit loop draws its first shuffle from the global generator
        states = checkpoint.get("rng_states")
        if states:
            torch.set_rng_state(states["torch"])
            name, keys, pos, has_gauss, gauss = states["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
            random.setstate(states["python"])

    # -- optimisation ------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        opt = build_adamw(self.model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.layer_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        max_epochs = self.trainer.max_epochs
        steps_per_epoch = total / max_epochs if max_epochs and max_epochs > 0 else total
        warmup = min(total, max(1, round(hp.warmup_epochs * steps_per_epoch))) if hp.warmup_epochs > 0 else 0
        ratio = hp.min_lr / hp.lr
        fn = lambda s: warmup_cosine(s, warmup, total, ratio)  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, scaled_lambda(fn, [g["lr_scale"] for g in opt.param_groups]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
