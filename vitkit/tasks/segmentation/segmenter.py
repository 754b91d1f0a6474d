"""``Segmenter``: a segmentation model trained with the training base's machinery (AdamW, warmup + cosine or poly
decay, EMA, skipped non-finite steps, exact resume), cross-entropy on the pixels that count (and the auxiliary
head's, and Dice if asked), validated by mIoU and pixel accuracy from a confusion matrix summed over every rank.
The backbone trains whole, frozen, or through LoRA adapters; a linear head may start fitted on the frozen features
(``probe.py``)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

import vitkit
from vitkit.evaluation.segmentation import scores
from vitkit.lora import DEFAULTS as LORA
from vitkit.lora import add_lora, check_adaptation, settings_of
from vitkit.models.segmentation import build_segmenter
from vitkit.training.base import TrainingModule
from vitkit.training.callbacks import probe_path
from vitkit.training.hparams import record_config
from vitkit.training.recipe import Recipe

from .probe import fit_probe_head


def dice_loss(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """1 - the soft Dice coefficient, averaged over classes, over the pixels that count."""
    keep = (target != ignore_index).unsqueeze(1)
    probs = logits.float().softmax(1) * keep
    onehot = F.one_hot(target.clamp(0, logits.shape[1] - 1), logits.shape[1]).permute(0, 3, 1, 2) * keep
    inter = (probs * onehot).sum((0, 2, 3))
    return 1 - ((2 * inter + 1) / (probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1)).mean()


class Segmenter(TrainingModule):
    """A head on a vitkit backbone, per-pixel classes.

    Args:
        model_name: the backbone: a preset or a pretrained name (``vit_small_patch14_dinov2.lvd142m``,
            ``swin_tiny_patch4_window7_224.ms_in1k``), as ``ImageClassifier`` takes it.
        head: ``linear`` (DINOv2's: a BatchNorm and a 1x1 conv on the last layer's patches), ``upernet`` or
            ``dpt`` (``vitkit/models/segmentation.py``).
        pretrained: load the name's weights (offline-first).
        checkpoint: the backbone's weights from a file (any format vitkit reads).
        num_classes: classes of the masks (linked from the data module).
        img_size: input resolution (linked from the data module).
        model_overrides: the backbone's config fields.
        head_args: the head's arguments (``channels``, ``pool_scales``).
        indices: the layers the head reads (default: see ``build_segmenter``).
        class_names: stored in the checkpoint (linked from the data module).
        ignore_index: the mask value no loss or score counts (linked from the data module).
        freeze_backbone: train the head alone (the backbone in eval mode, no gradients).
        head_init: ``random``, or ``probe`` (a linear head): before the first step the head is fitted on the frozen
            backbone's patch features of the training images (``probe.py``); its validation mIoU is logged as
            ``val/probe_baseline``, its model saved as ``probe.ckpt``, and the run's best checkpoint is never
            below it.
        aux_weight: the auxiliary head's share of the loss (UperNet on Swin; mmsegmentation's 0.4).
        dice_weight: a Dice term's share of the loss (0: cross-entropy alone).
        schedule: the decay after warmup: ``cosine``, or ``poly`` (mmsegmentation's, power 0.9).
        lora_rank, lora_alpha, lora_dropout, lora_targets, lora_parts, lora_lr_scale: LoRA adapters in the
            backbone (``vitkit/lora.py``); the adapters and the head train, nothing else.
        lr, weight_decay, betas, min_lr, warmup_epochs, layer_decay, ema_decay, ema_is_model, nonfinite_loss,
            compile: as for ``ImageClassifier``.
    """

    def __init__(
        self,
        model_name: str = "vit_small_patch14_dinov2",
        head: Literal["linear", "upernet", "dpt"] = "linear",
        pretrained: bool = False,
        checkpoint: str | None = None,
        num_classes: int | None = None,
        img_size: int | tuple[int, int] | None = None,
        model_overrides: dict[str, Any] | None = None,
        head_args: dict[str, Any] | None = None,
        indices: list[int] | None = None,
        class_names: list[str] | None = None,
        ignore_index: int = 255,
        freeze_backbone: bool = False,
        head_init: Literal["random", "probe"] = "random",
        aux_weight: float = 0.4,
        dice_weight: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        min_lr: float = 0.0,
        warmup_epochs: float = 1.0,
        schedule: Literal["cosine", "poly"] = "cosine",
        layer_decay: float | None = None,
        ema_decay: float | None = None,
        ema_is_model: bool = False,
        lora_rank: int = LORA.rank,
        lora_alpha: float | None = LORA.alpha,
        lora_dropout: float = LORA.dropout,
        lora_targets: list[str] | None = None,  # None: LORA.targets
        lora_parts: str = LORA.parts,
        lora_lr_scale: float = 10.0,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.recipe = Recipe(lr=lr, weight_decay=weight_decay, betas=betas, min_lr=min_lr, warmup_epochs=warmup_epochs,
                             schedule=schedule, layer_decay=layer_decay, ema_decay=ema_decay,
                             ema_is_model=ema_is_model, nonfinite_loss=nonfinite_loss, compile=compile)
        if aux_weight < 0 or dice_weight < 0:
            raise ValueError(f"aux_weight and dice_weight must be >= 0 (0: no such term), got {aux_weight} and "
                             f"{dice_weight}")
        if num_classes is None or num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 (the data module gives it), got {num_classes}")
        overrides = dict(model_overrides or {})
        if img_size is not None:
            overrides["img_size"] = img_size
        backbone = vitkit.create_model(model_name, pretrained=pretrained, checkpoint=checkpoint, num_classes=0,
                                       **overrides)
        if getattr(backbone, "load_report", None) is not None:
            rank_zero_info(str(backbone.load_report))
        self.model = build_segmenter(backbone, head, num_classes, indices, **(head_args or {}))
        self.hparams.indices = self.model.indices  # what ran, for the checkpoint
        self._adapt()
        self.confusion = torch.nn.ModuleDict({s: MulticlassConfusionMatrix(num_classes, ignore_index=ignore_index)
                                              for s in ("val", "test", "probe")})
        self.make_ema(self.recipe.ema_decay, self.recipe.ema_is_model)
        self.probe_baseline: float | None = None
        self.probe_file = ""

    def _adapt(self) -> None:
        """The backbone frozen, or adapted by LoRA (the head trains in both), as the arguments ask."""
        hp = self.hparams
        if hp.head_init not in ("random", "probe") or (hp.head_init == "probe" and hp.head != "linear"):
            raise ValueError(f"head_init must be 'random' or 'probe' (with the linear head: the probe is a linear "
                             f"regression on the patch features), got {hp.head_init!r} with head {hp.head!r}")
        lora = settings_of(hp)
        check_adaptation(lora, hp.freeze_backbone, hp.lora_lr_scale)
        if hp.freeze_backbone:
            self.model.backbone.requires_grad_(False).eval()
        elif lora.rank:
            self.lora_layers = add_lora(self.model.backbone, lora)  # the backbone frozen but for its adapters

    def adapter_lr_scale(self) -> float:
        return self.hparams.lora_lr_scale

    def forward(self, x: Tensor) -> Tensor:
        return self.evaluated()(x)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if checkpoint.get("hyper_parameters") is not None:  # the backbone file's shapes: rebuilt without the file
            record_config(self.model.backbone, checkpoint["hyper_parameters"])
        if self.probe_baseline is not None:
            checkpoint["probe_baseline"], checkpoint["probe_file"] = self.probe_baseline, self.probe_file

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.probe_baseline = checkpoint.get("probe_baseline", self.probe_baseline)
        self.probe_file = checkpoint.get("probe_file", self.probe_file)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.hparams.head_init == "probe" and self.trainer.ckpt_path is None and not self.trainer.fast_dev_run:
            self._fit_probe_head()

    def _fit_probe_head(self) -> None:
        """``head_init="probe"``: the linear head fitted on the frozen patch features, its mIoU logged and its model
        saved."""
        dm = self.trainer.datamodule
        hp = self.hparams
        images = 0  # counted as read: a streamed split has no length before

        def batches():
            nonlocal images
            for b in dm.loader(dm.eval_view("train"), False):
                images += len(b[1])
                yield dm.on_after_batch_transfer(b, 0)

        patches = fit_probe_head(self.model, batches(), self.model.num_classes, hp.ignore_index, self.device)
        self.restart_ema()
        self.probe_baseline = self._score(dm.val_dataloader())
        for logger in self.trainer.loggers:
            logger.log_metrics({"val/probe_baseline": self.probe_baseline}, step=0)
        path = probe_path(self.trainer)
        self.trainer.save_checkpoint(path, weights_only=True)  # the model at step 0: no optimizer state yet
        self.probe_file = str(path)
        rank_zero_info(f"probe: a logistic regression on the frozen features of {patches} patches of "
                       f"{images} training images, val/mIoU {self.probe_baseline:.4f} "
                       f"(val/probe_baseline): {path}")

    @torch.no_grad()
    def _score(self, loader) -> float:
        """The mIoU of the model as it is on ``loader``'s batches, summed over every rank."""
        was_training, dm = self.training, self.trainer.datamodule
        self.eval()
        matrix = self.confusion["probe"]
        for batch in loader:
            x, y = dm.on_after_batch_transfer((batch[0].to(self.device), batch[1].to(self.device)), 0)
            matrix.update(self(x).argmax(1), y)
        miou = scores(matrix.compute().cpu().numpy())[1]
        matrix.reset()
        self.train(was_training)
        return miou

    def train(self, mode: bool = True) -> Segmenter:
        """A frozen backbone stays in eval mode: its drop path and dropout off, as at inference."""
        super().train(mode)
        if mode and self.hparams.freeze_backbone:
            self.model.backbone.eval()
        return self

    def step_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits, aux = self.model.forward_train(x)
        hp = self.hparams
        loss = F.cross_entropy(logits.float(), y, ignore_index=hp.ignore_index)
        if aux is not None and hp.aux_weight:
            loss = loss + hp.aux_weight * F.cross_entropy(aux.float(), y, ignore_index=hp.ignore_index)
        if hp.dice_weight:
            loss = loss + hp.dice_weight * dice_loss(logits, y, hp.ignore_index)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], split: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{split}/loss", F.cross_entropy(logits.float(), y, ignore_index=self.hparams.ignore_index),
                 prog_bar=split == "val", sync_dist=True, batch_size=len(x))
        self.confusion[split].update(logits.argmax(1), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _log_scores(self, split: str) -> None:
        iou, miou, acc = scores(self.confusion[split].compute().cpu().numpy())  # summed over every rank
        self.confusion[split].reset()
        self.log(f"{split}/mIoU", miou, prog_bar=True, sync_dist=False)
        self.log(f"{split}/pixel_acc", acc, sync_dist=False)
        names = self.hparams.class_names or [str(i) for i in range(len(iou))]
        for name, value in zip(names, iou.tolist(), strict=True):  # NaN: a class in neither
            if value == value:  # a class seen in this split
                self.log(f"{split}/IoU/{name}", value, sync_dist=False)

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val")

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(1)
