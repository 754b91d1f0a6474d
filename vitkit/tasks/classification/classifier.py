"""Image classification with Lightning: the DeiT/Swin recipe around any vitkit preset."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from timm.data.mixup import mixup_target
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

import vitkit
from vitkit.evaluation import multilabel as ml
from vitkit.evaluation.metrics import Predictions
from vitkit.lora import DEFAULTS as LORA
from vitkit.lora import LoraSettings, add_lora, check_adaptation, settings_of
from vitkit.training.base import EMA, TrainingModule
from vitkit.training.callbacks import probe_path
from vitkit.training.hparams import record_config

from .distill import (
    Distillation,
    Preprocessing,
    build_teacher,
    check_distillation,
    classes_of,
    distillation_loss,
    to_teacher,
)
from .multilabel import (
    CHECKPOINT_KEY,
    MultiLabelLoss,
    ValidationPredictions,
    check_multi_label,
    loss_of,
    pos_weight_of,
    soft_targets,
)
from .multilabel import metrics as multilabel_metrics
from .probe import HeadNorm, fold_into_checkpoint, unfold_from_checkpoint
from .report import collect, write_test_report
from .small_data import fit_head, keep_what_trained, suggest_small_data_recipe

__all__ = ["EMA", "ImageClassifier"]
log = logging.getLogger(__name__)


def _warn_whole_model_augmentation(hp, datamodule) -> None:
    """A frozen backbone with a fine-tuning recipe's augmentation, made for training the whole model: its head
    learns from features of mixed, erased and RandAugmented images, and lands far below a probe of the same
    features."""
    data = datamodule.augmentation() if hasattr(datamodule, "augmentation") else getattr(datamodule, "hparams", {})
    heavy = [f"{k} {v}" for k, v in (("mixup", hp.mixup), ("cutmix", hp.cutmix), ("re_prob", data.get("re_prob")),
                                      ("auto_augment", data.get("auto_augment"))) if v]
    if heavy:
        log.warning("--model.freeze_backbone with %s: this augmentation is meant for training the whole model; a "
                    "frozen backbone's head learns better with the linear-probe recipe: `vitkit train fit -c "
                    "linear_probe --model.checkpoint BACKBONE --data.root DATA`", ", ".join(heavy))


def _build_model(name: str, pretrained: bool, checkpoint: str | None, num_classes: int | None,
                 img_size: int | tuple[int, int] | None, overrides: dict[str, Any] | None) -> nn.Module:
    if vitkit.family(name) == "seq2seq":
        raise ValueError(f"{name!r} is an encoder-decoder preset; train it with "
                         "--model vitkit.lit.Seq2SeqModule (class_path: vitkit.lit.Seq2SeqModule in a config)")
    overrides = dict(overrides or {})
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if img_size is not None:
        overrides["img_size"] = img_size
    model = vitkit.create_model(name, pretrained=pretrained, checkpoint=checkpoint, **overrides)
    if getattr(model, "load_report", None) is not None:
        rank_zero_info(str(model.load_report))
    return model


class ImageClassifier(TrainingModule):
    """A vitkit preset trained with AdamW, warmup + cosine, label smoothing, mixup/cutmix and EMA.

    Every argument is serializable, so ``ImageClassifier.load_from_checkpoint(path)`` rebuilds the model
    with or without the CLI.

    The arguments come in groups, in this order: the model and its weights (``model_name`` to ``class_names``);
    several labels per image (``multi_label`` to ``thresholds``); the recipe (``lr`` to ``compile``); then three
    modes, any of which a run may add: probing and small data
    (``freeze_backbone``, ``head_norm``, ``head_init``), low-rank adapters (``lora_*``) and distillation from a
    teacher (``teacher``, ``distillation``, ``distill_*``).

    Args:
        model_name: a preset from ``vitkit.list_models()``, or a pretrained name: a timm tag
            (``vit_base_patch16_224.augreg2_in21k_ft_in1k``) or torchvision weights
            (``ViT_B_16_Weights.IMAGENET1K_V1``), whose mean, std, crop and interpolation the data follows.
        pretrained: load that name's weights (from the Hugging Face or torch hub cache, downloaded only when
            missing); positions / windows are resampled to ``img_size`` and a new head is made for ``num_classes``.
        checkpoint: pretrained weights to start from (a file or folder of any format vitkit reads, see
            ``vitkit.checkpoints``), adapted as with ``pretrained``. Read when the module is built; resuming
            with ``--ckpt_path`` then replaces them with the run's own. A checkpoint this module writes holds
            every weight, so it records ``pretrained: false`` and no ``checkpoint``: ``load_from_checkpoint``
            reads nothing else.
        num_classes: classes of the data (linked from the data module by the CLI).
        img_size: input resolution, one int or (H, W) (linked from the data module by the CLI); None keeps the
            preset's.
        model_overrides: any other config field of the preset, e.g. ``{"depth": 6, "drop_path_rate": 0.1}``.
        class_names: stored in the checkpoint for prediction (linked from the data module).
        multi_label: several labels per image (``multilabel.py``): multi-hot targets (a
            ``ManifestDataModule`` or ``HFDataModule`` gives them; class indices become one-hot rows), a sigmoid per
            class, validation by mAP (``val/mAP``, ``val/mAP_micro``, ``val/f1``). ``label_smoothing`` moves each
            target towards 0.5; mixup and cutmix mix the multi-hot rows.
        multi_label_loss: ``bce`` (binary cross-entropy with logits, the mean over images and classes) or ``asl``
            (the asymmetric loss, summed over classes).
        pos_weight: weigh each class's positives by its negatives / positives in the training set.
        thresholds: how each class's decision threshold is chosen on the validation predictions after each
            validation (and kept in the checkpoint, exported models and ``vitkit predict``): ``per_class`` (maximum
            F1 for each class), ``global`` (one threshold, maximum micro F1) or ``fixed`` (0.5).
        lr: peak learning rate (for the whole batch; the configs scale it as lr_base x batch / 512).
        min_lr: floor of the cosine.
        warmup_epochs: linear warmup length, stepped per optimizer step.
        layer_decay: layer-wise LR decay (e.g. 0.65 for fine-tuning); None disables.
        weight_decay: the optimizer's weight decay (not on norms, biases, tokens and positions).
        betas: AdamW's betas.
        optimizer: ``adamw`` (the default; ``betas``) or ``sgd`` with ``momentum`` (the linear probe's).
        momentum: SGD's momentum.
        label_smoothing: soft targets (timm's soft-target CE); for several labels, each target moves towards 0.5.
        mixup: timm's Mixup alpha (0 disables).
        cutmix: timm's CutMix alpha (0 disables).
        mixup_prob: the share of batches mixed.
        mixup_switch_prob: the share of mixed batches that take CutMix when both are on.
        ema_decay: keep an EMA of the weights, validated alongside (``val/top1_ema``); None disables.
        ema_is_model: the EMA is the run's model: validation (``val/top1``), test, predict and the checkpoint's
            ``model.`` weights are the average's; the weights being trained ride in the checkpoint's ``ema.``
            entries for resuming (so ``use_ema=True`` reads those).
        nonfinite_loss: what a NaN/Inf training loss does: ``stop`` ends the run with an error (the last
            good checkpoint stays as it was), ``skip`` drops that step on every rank and goes on (and
            still stops after 10 bad steps in a row).
        compile: run the model under ``torch.compile`` (compiled in place in ``configure_model``, so the
            state_dict and checkpoints keep the plain parameter names).
        freeze_backbone: train only the head (linear probe).
        head_norm: MAE's linear probe: a BatchNorm without affine parameters between the pooled features and the
            head (``probe.py``), folded into the head in every checkpoint.
        head_init: ``random`` (the model's initialisation), or ``probe``: before the first step the head is fitted
            on the frozen backbone's features of the training images, a logistic regression whose validation top-1
            is logged as ``val/probe_baseline`` and whose model is saved as ``probe.ckpt``
            (``small_data.py``; the ``finetune_small_data`` recipe).
        lora_rank: low-rank adapters through peft (``vitkit/lora.py``): rank R > 0 trains adapters on the
            ``lora_targets`` layers and the head, nothing else. The checkpoint holds what trained and names the
            backbone.
        lora_alpha: the adapters' scale is alpha / rank; None: the rank.
        lora_dropout: dropout on the adapters' input.
        lora_targets: timm's module names to adapt (default the attention's qkv and proj).
        lora_parts: ``qkv``, or ``qv`` to adapt only the query and value rows of a fused qkv.
        lora_lr_scale: the adapters' LR is ``lr`` x this, without layer decay (they start from zero in every
            block); the head keeps ``lr``.
        teacher: knowledge distillation from a frozen teacher (``distill.py``): a vitkit preset or timm
            tag (pretrained, offline-first), any timm model by name (``regnety_160.deit_in1k``), or a file or folder
            vitkit reads; it must predict the data's classes. ``teacher_checkpoint``: the weights of a named one.
        distillation: ``hard`` (DeiT's: the teacher's argmax for the distillation head, or the one head),
            ``soft`` (KL at temperature ``distill_tau``, scaled by tau²) or ``none``; default ``hard`` with a teacher.
        distill_alpha: the distillation term's share of the loss (the label loss has the rest).
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        pretrained: bool = False,
        num_classes: int | None = None,
        img_size: int | tuple[int, int] | None = None,
        model_overrides: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        multi_label: bool = False,
        multi_label_loss: MultiLabelLoss = "bce",
        pos_weight: bool = False,
        thresholds: ml.ThresholdMode = "per_class",
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
        ema_is_model: bool = False,
        freeze_backbone: bool = False,
        checkpoint: str | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        compile: bool = False,
        teacher: str | None = None,
        teacher_checkpoint: str | None = None,
        distillation: Distillation | None = None,
        distill_alpha: float = 0.5,
        distill_tau: float = 1.0,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        momentum: float = 0.9,
        head_norm: bool = False,
        head_init: Literal["random", "probe"] = "random",
        lora_rank: int = LORA.rank,
        lora_alpha: float | None = LORA.alpha,
        lora_dropout: float = LORA.dropout,
        lora_targets: list[str] | None = None,  # None: LORA.targets
        lora_parts: str = LORA.parts,
        lora_lr_scale: float = 10.0,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        check_multi_label(multi_label, multi_label_loss, thresholds, teacher, distillation)
        self.distillation = check_distillation(distillation, teacher, distill_alpha, distill_tau)
        self.model = _build_model(model_name, pretrained, checkpoint, num_classes, img_size, model_overrides)
        self._adapt(settings_of(self.hparams), head_init)
        self.num_classes = self.model.cfg.num_classes
        self.head_norm = HeadNorm(self.model) if head_norm else None  # MAE's linear probe (probe.py)
        self._set_teacher(teacher, teacher_checkpoint)
        self.make_ema(ema_decay, ema_is_model)
        self._set_targets(multi_label)

    def _set_targets(self, multi_label: bool) -> None:
        """timm's Mixup (of class indices, or of multi-hot rows) and the metrics: top-1 and top-5, or for several
        labels per image mAP, micro AP and F1 at the per-class thresholds."""
        hp = self.hparams
        self.mixup = Mixup(mixup_alpha=hp.mixup, cutmix_alpha=hp.cutmix, prob=hp.mixup_prob,
                           switch_prob=hp.mixup_switch_prob, label_smoothing=hp.label_smoothing,
                           num_classes=self.num_classes, multi_label=multi_label) \
            if hp.mixup > 0 or hp.cutmix > 0 else None
        self.multi_label = multi_label
        if not multi_label:
            self.metrics = nn.ModuleDict({
                f"{split}_{k}": MulticlassAccuracy(self.num_classes, top_k=t, average="micro")
                for split in ("val", "val_ema", "test") for k, t in (("top1", 1), ("top5", min(5, self.num_classes)))})
            return
        self.metrics = multilabel_metrics(self.num_classes)
        self.register_buffer("thresholds", torch.full((self.num_classes,), 0.5), persistent=False)
        self.pos_weight: Tensor | None = None
        self._val_predictions = ValidationPredictions()

    def _adapt(self, lora: LoraSettings, head_init: str) -> None:
        """A frozen backbone, LoRA adapters (``vitkit/lora.py``) or the probe's head (``small_data.py``), as the
        arguments ask."""
        hp = self.hparams
        if hp.freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith("head"))
            self._backbone_to_eval()
        self.lora = lora
        check_adaptation(lora, hp.freeze_backbone, hp.get("lora_lr_scale", 1.0))
        if lora.rank:
            self.lora_layers = add_lora(self.model, lora)  # everything frozen but the adapters ...
            for name, p in self.model.named_parameters():
                p.requires_grad_(p.requires_grad or name.startswith("head"))  # ... and the head
        if hp.ema_is_model and hp.head_norm:
            raise ValueError("ema_is_model and head_norm: the probe's normalisation is folded into the model that "
                             "trains; keep one of them")
        if head_init not in ("random", "probe") or (head_init == "probe" and (hp.head_norm or hp.freeze_backbone)):
            raise ValueError(f"head_init must be 'random' or 'probe' (without head_norm or freeze_backbone: the probe "
                             f"is the fitted head), got {head_init!r}")
        self.probe_baseline: float | None = None
        self.probe_file = ""

    def forward(self, x: Tensor) -> Tensor:
        return self.evaluated()(x) if self.head_norm is None else self.head_norm(self.model, x)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if checkpoint.get("hyper_parameters") is not None:
            record_config(self.model, checkpoint["hyper_parameters"])
        if self.head_norm is not None:  # the file is a plain classifier; the probe as trained rides beside it
            fold_into_checkpoint(self.head_norm, self.model, checkpoint)
        if self.probe_baseline is not None:
            checkpoint["probe_baseline"], checkpoint["probe_file"] = self.probe_baseline, self.probe_file
        if self.lora.rank:
            keep_what_trained(self, checkpoint)
        if self.multi_label:
            checkpoint[CHECKPOINT_KEY] = {"thresholds": self.thresholds.tolist(), "mode": self.hparams.thresholds}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.head_norm is not None:
            unfold_from_checkpoint(self.model, checkpoint)
        self.probe_baseline = checkpoint.get("probe_baseline", self.probe_baseline)
        self.probe_file = checkpoint.get("probe_file", self.probe_file)
        if self.multi_label and CHECKPOINT_KEY in checkpoint:
            self.thresholds.copy_(torch.tensor(checkpoint[CHECKPOINT_KEY]["thresholds"]))
        if self.lora.rank:  # the frozen backbone is this module's, read from the file the checkpoint names
            own = self.state_dict()
            checkpoint["state_dict"] = {**{k: v for k, v in own.items() if k not in checkpoint["state_dict"]},
                                        **checkpoint["state_dict"]}

    # -- a teacher (distill.py) -----------------------------------------------------------------------------

    def _set_teacher(self, teacher: str | None, checkpoint: str | None) -> None:
        self._teacher = None
        if self.distillation == "none":
            return
        model, self._teacher_prep = build_teacher(teacher, checkpoint)
        classes = classes_of(model)
        if classes != self.num_classes:
            raise ValueError(f"the teacher {teacher!r} predicts {classes} classes, the data has {self.num_classes}: a "
                             "teacher must classify the same classes (fine-tune it on the data first)")
        # not a submodule: outside the optimizer, the state dict, the checkpoint, DDP and FSDP2 (replicated)
        object.__setattr__(self, "_teacher", model)
        cfg = self.model.cfg
        size = cfg.img_size if isinstance(cfg.img_size, (tuple, list)) else (cfg.img_size, cfg.img_size)
        self._student_prep = Preprocessing(tuple(cfg.mean), tuple(cfg.std), tuple(size))
        if getattr(self.model, "head_dist", None) is not None:
            self.model.set_distilled_training(True)  # training returns (class head, distillation head)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._check_targets(getattr(self.trainer, "datamodule", None))
        if self.hparams.head_init == "probe" and self.trainer.ckpt_path is None and not self.trainer.fast_dev_run:
            self._fit_probe_head()
        elif self.hparams.head_init == "random":
            suggest_small_data_recipe(self, getattr(self.trainer, "datamodule", None))
        if self.hparams.freeze_backbone:
            _warn_whole_model_augmentation(self.hparams, getattr(self.trainer, "datamodule", None))
        self._keep_crop_mode(getattr(self.trainer, "datamodule", None))
        if self._teacher is not None:  # the student's device and, for a *-true precision, its dtype
            dtype = next(self.model.parameters()).dtype
            self._teacher.to(device=self.device, dtype=dtype if dtype.is_floating_point else None)
            data_cfg = getattr(getattr(self.trainer, "datamodule", None), "data_cfg", None)
            if data_cfg is not None:  # the batch is normalised as the data module does it
                self._student_prep.mean, self._student_prep.std = tuple(data_cfg.mean), tuple(data_cfg.std)

    def _keep_crop_mode(self, dm) -> None:
        """The data's crop_mode (``squash``: the whole image) becomes the model's, in its config and the checkpoint's
        overrides, so that predict, evaluate and exports prepare images as this run validated them."""
        mode = getattr(getattr(dm, "data_cfg", None), "crop_mode", None)
        if mode is None or mode == getattr(self.model.cfg, "crop_mode", mode):
            return
        self.model.configure(crop_mode=mode)
        self.hparams.model_overrides = {**(self.hparams.model_overrides or {}), "crop_mode": mode}

    def _check_targets(self, dm) -> None:
        """Multi-hot data needs ``multi_label``; with it, ``pos_weight`` is counted on the training set."""
        if getattr(dm, "multi_label", False) and not self.multi_label:
            raise ValueError(f"{dm.describe() if hasattr(dm, 'describe') else type(dm).__name__} gives several labels "
                             "per image (multi-hot targets); train with --model.multi_label true")
        if self.multi_label and self.hparams.pos_weight:
            self.pos_weight = pos_weight_of(dm, self.num_classes).to(self.device)

    def _fit_probe_head(self) -> None:
        """``head_init="probe"``: the head fitted on the frozen features, its score logged and its model saved."""
        dm = self.trainer.datamodule
        self.probe_baseline = fit_head(self.model, dm, self.device, self.multi_label)
        self.restart_ema()
        for logger in self.trainer.loggers:
            logger.log_metrics({"val/probe_baseline": self.probe_baseline}, step=0)
        path = probe_path(self.trainer)
        self.trainer.save_checkpoint(path, weights_only=True)  # the model at step 0: no optimizer state yet
        self.probe_file = str(path)
        score = "val/mAP" if self.multi_label else "val/top1"
        rank_zero_info(f"probe: a logistic regression on the frozen features of {len(dm.train_set)} training "
                       f"images, {score} {self.probe_baseline:.4f} (val/probe_baseline): {path}")

    # -- a frozen backbone is an inference model: its drop path and dropout stay off --------------------------

    def _backbone_to_eval(self) -> None:
        """With ``freeze_backbone``, every module of the model but the head (``head*``) in eval mode."""
        for name, child in self.model.named_children():
            if not name.startswith("head"):
                child.eval()

    def train(self, mode: bool = True) -> ImageClassifier:
        """``nn.Module.train``, which puts a frozen backbone back in eval mode: the head learns from the features
        the backbone gives at inference, not from features noised by its drop path."""
        super().train(mode)
        if mode and self.hparams.freeze_backbone:
            self._backbone_to_eval()
        return self

    def on_train_epoch_start(self) -> None:
        if self.hparams.freeze_backbone:  # a module's mode set without train() (a callback, a strategy) too
            self._backbone_to_eval()

    # -- steps -------------------------------------------------------------------------------------

    def step_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self._loss(*batch)

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        if self.multi_label:
            target = soft_targets(self.mixup, x, self._multi_hot(y), self.num_classes, self.hparams.label_smoothing)
            return loss_of(self.hparams.multi_label_loss, self(x), target, self.pos_weight)
        soft = self._mix(x, y) if self.mixup is not None else None  # with label smoothing; x is mixed in place
        out = self(x)
        logits, distilled = out if isinstance(out, tuple) else (out, out)  # DeiT's two heads, or the one
        if soft is not None:
            loss = torch.sum(-soft * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.hparams.label_smoothing)
        if self._teacher is None:
            return loss
        with torch.no_grad():  # the same (mixed) images, as the teacher wants them
            teacher = self._teacher(to_teacher(x, self._student_prep, self._teacher_prep))
        alpha = self.hparams.distill_alpha
        return (1 - alpha) * loss + alpha * distillation_loss(self.distillation, distilled, teacher,
                                                              self.hparams.distill_tau)

    def _multi_hot(self, y: Tensor) -> Tensor:
        """Multi-hot rows (N, C), from class indices where the data gives one label per image."""
        return F.one_hot(y, self.num_classes).float() if y.ndim == 1 else y.float()

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
        super().on_train_epoch_end()
        self._report_skipped("train")

    def on_validation_epoch_end(self) -> None:
        self._report_skipped("val")
        if self.multi_label:  # every rank gathers the epoch's predictions and chooses the same thresholds
            probs, targets = self._val_predictions.gathered(self.trainer)
            if len(probs) and not self.trainer.sanity_checking:
                self.thresholds.copy_(ml.choose_thresholds(probs, targets, self.hparams.thresholds))

    def on_test_epoch_start(self) -> None:
        self._test_predictions = ml.empty_predictions(self.num_classes) if self.multi_label else \
            Predictions(torch.empty(0), torch.empty(0, dtype=torch.long), [])

    def on_test_epoch_end(self) -> None:
        self._report_skipped("test")
        for name, value in write_test_report(self, self._test_predictions).items():
            self.log(f"test/{name}", value)

    def _report_skipped(self, split: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "report_skipped"):
            self.log(f"{split}/skipped_files", float(dm.report_skipped(split)))

    def _evaluate(self, batch: tuple[Tensor, Tensor], split: str) -> Tensor | None:
        x, y = batch
        if len(y) == 0:  # every file of the batch was unreadable
            return None
        if self.multi_label:
            return self._evaluate_multi_label(x, self._multi_hot(y), split)
        logits = self(x)
        self.log(f"{split}/loss", F.cross_entropy(logits.float(), y), prog_bar=split == "val", sync_dist=True,
                 batch_size=x.shape[0])
        for k in ("top1", "top5"):
            self.metrics[f"{split}_{k}"](logits, y)
            self.log(f"{split}/{k}", self.metrics[f"{split}_{k}"], prog_bar=k == "top1", batch_size=x.shape[0])
        if split == "val" and self.ema is not None and not self.ema_is_model:
            ema_logits = self.ema(x)
            for k in ("top1", "top5"):
                self.metrics[f"val_ema_{k}"](ema_logits, y)
                self.log(f"val/{k}_ema", self.metrics[f"val_ema_{k}"], batch_size=x.shape[0])
        return logits

    def _evaluate_multi_label(self, x: Tensor, y: Tensor, split: str) -> Tensor:
        """The BCE loss, mAP, micro AP and F1 at the current thresholds; the predictions kept for the thresholds."""
        logits = self(x)
        n = x.shape[0]
        self.log(f"{split}/loss", F.binary_cross_entropy_with_logits(logits.float(), y), prog_bar=split == "val",
                 sync_dist=True, batch_size=n)
        runs = [("", logits)] + ([("_ema", self.ema(x))] if split == "val" and self.ema is not None
                                 and not self.ema_is_model else [])
        for suffix, out in runs:
            probs, key = out.float().sigmoid(), f"{split}{suffix}"
            for name, value in (("mAP", probs), ("mAP_micro", probs), ("f1", ml.decide(probs, self.thresholds))):
                self.metrics[f"{key}_{name}"](value, y.long())
                self.log(f"{split}/{name}{suffix}", self.metrics[f"{key}_{name}"],
                         prog_bar=name == "mAP" and not suffix, batch_size=n)
        if split == "val":
            self._val_predictions.add(logits, y)
        return logits

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits = self._evaluate(batch, "test")
        if logits is not None:  # for the report of `vitkit train test` (below)
            collect(self._test_predictions, self.trainer, batch, logits, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).sigmoid() if self.multi_label else self(x).softmax(dim=-1)
