"""``Segmenter``: a segmentation model trained with the training base's machinery (AdamW, warmup + cosine or poly
decay, EMA, skipped non-finite steps, exact resume), cross-entropy on the pixels that count (and the auxiliary
head's, and Dice if asked), validated by mIoU and pixel accuracy from a confusion matrix summed over every rank.
The backbone trains whole, frozen, or through LoRA adapters; a linear head may start fitted on the frozen features
(``probe.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from jsonargparse import lazy_instance
from torch import Tensor, nn
from torchmetrics.classification import MulticlassConfusionMatrix

from vitkit.errors import UsageError
from vitkit.evaluation.segmentation import scores
from vitkit.models.segmentation import SegmentationOutput, build_segmenter
from vitkit.training.adaptation import Adaptation, Full, headless_backbone
from vitkit.training.base import TrainingModule
from vitkit.training.hparams import record_config
from vitkit.training.parts import config_of, part_from
from vitkit.training.recipe import Recipe

from .parts import LOSS, SEGMENTER_FLAT, Linear, SegmentationHead, SegmentationLoss
from .probe_first import fit_probe_head


def dice_loss(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """1 - the soft Dice coefficient, averaged over classes, over the pixels that count."""
    keep = (target != ignore_index).unsqueeze(1)
    probs = logits.float().softmax(1) * keep
    onehot = F.one_hot(target.clamp(0, logits.shape[1] - 1), logits.shape[1]).permute(0, 3, 1, 2) * keep
    inter = (probs * onehot).sum((0, 2, 3))
    return 1 - ((2 * inter + 1) / (probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1)).mean()


RECIPE = SEGMENTER_FLAT.recipe  # Meta's linear heads: AdamW 1e-3
WHOLE_MODEL = lazy_instance(Full)  # the defaults LightningCLI shows by class path
LINEAR = lazy_instance(Linear)


class Segmenter(TrainingModule):
    """A head on a vitkit backbone, per-pixel classes.

    Built from typed parts: the ``recipe`` and the ``adaptation`` the classifier takes
    (``--model.adaptation LoRA --model.adaptation.rank 8``), and its own ``head`` and ``loss`` (``parts.py``); a
    checkpoint of the flat arguments that came before them (``lr``, ``freeze_backbone``, ``head: upernet``,
    ``head_args``, ``aux_weight``, ...) is upgraded once by ``vitkit convert OLD.ckpt NEW.ckpt``.

    Args:
        model_name: the backbone: a preset or a pretrained name (``vit_small_patch14_dinov2.lvd142m``,
            ``swin_tiny_patch4_window7_224.ms_in1k``), as ``ImageClassifier`` takes it.
        head: ``Linear`` (DINOv2's: a BatchNorm and a 1x1 conv on the last layer's patches), ``UperNet`` or
            ``DPT``, with its settings and the layers it reads (``indices``; ``parts.py``).
        pretrained: load the name's weights (offline-first).
        checkpoint: the backbone's weights from a file (any format vitkit reads).
        num_classes: classes of the masks (linked from the data module).
        img_size: input resolution (linked from the data module).
        model_overrides: the backbone's config fields.
        class_names: stored in the checkpoint (linked from the data module).
        ignore_index: the mask value no loss or score counts (linked from the data module).
        loss: the auxiliary head's share of the loss (``aux_weight``: UperNet on Swin; mmsegmentation's 0.4) and a
            Dice term's (``dice_weight``; 0: cross-entropy alone).
        recipe: the optimizer, schedule, EMA and steps (``vitkit.training.recipe.Recipe``; ``schedule: poly`` is
            mmsegmentation's ``(1 - progress) ** 0.9``). Default: AdamW at 1e-3, weight decay 1e-4, a warmup of one
            epoch, then cosine decay.
        adaptation: ``Full`` (every weight trains), ``Frozen`` (the head alone; the backbone in eval mode, no
            gradients) or ``LoRA`` (adapters in the backbone, and the head), as for ``ImageClassifier``; with
            ``head_init: probe`` (a linear head) the head is fitted on the frozen backbone's patch features of the
            training images before the first step (``probe.py``): its validation mIoU is logged as
            ``val/probe_baseline``, its model saved as ``probe.ckpt``, and the run's best checkpoint is never below
            it.
    """

    FLAT = SEGMENTER_FLAT  # the flat arguments of before the parts, and what each became

    def __init__(
        self,
        model_name: str = "vit_small_patch14_dinov2",
        head: SegmentationHead = LINEAR,
        pretrained: bool = False,
        checkpoint: str | None = None,
        num_classes: int | None = None,
        img_size: int | tuple[int, int] | None = None,
        model_overrides: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        ignore_index: int = 255,
        loss: SegmentationLoss = LOSS,
        recipe: Recipe = RECIPE,
        adaptation: Adaptation = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.adaptation = part_from(adaptation, Adaptation, Full())
        self.hparams.adaptation = config_of(self.adaptation)  # plain values, as the recipe's
        self.head = part_from(head, SegmentationHead, Linear())
        self.loss = loss if isinstance(loss, SegmentationLoss) else SegmentationLoss(**dict(loss or {}))
        self.hparams.loss = dataclasses.asdict(self.loss)
        if num_classes is None or num_classes < 1:
            raise UsageError(f"num_classes must be >= 1 (the data module gives it), got {num_classes}")
        if self.adaptation.head_init == "probe" and not isinstance(self.head, Linear):  # before the backbone is read
            raise UsageError(f"head_init 'probe' fits the linear head (a linear regression on the patch features), and "
                             f"the head is {type(self.head).__name__}: give --model.adaptation.head_init random with "
                             "it")
        backbone = headless_backbone(model_name, pretrained, checkpoint, img_size, model_overrides)
        self.model = build_segmenter(backbone, self.head.name, num_classes, self.head.indices,
                                     **self.head.build_args())
        self.head.indices = list(self.model.indices)  # what ran, for the checkpoint
        self.hparams.head = config_of(self.head)
        self._adapt()
        self.confusion = torch.nn.ModuleDict({s: MulticlassConfusionMatrix(num_classes, ignore_index=ignore_index)
                                              for s in ("val", "test", "probe")})
        self.make_ema(self.recipe.ema_decay, self.recipe.ema_is_model)
        self.probe_baseline: float | None = None
        self.probe_file = ""

    def _adapt(self) -> None:
        """The backbone adapted as the adaptation part says (the head trains under every one)."""
        how = self.adaptation
        if how.head_norm:
            raise UsageError("head_norm is a classifier's probe normalisation; a segmenter's linear head has its own "
                             "BatchNorm")
        how.apply(self)

    def adapter_lr_scale(self) -> float:
        return self.adaptation.adapter_lr_scale()

    def adapted(self) -> nn.Module:
        """Where LoRA adapters go: the backbone."""
        return self.model.backbone

    @staticmethod
    def is_head(name: str) -> bool:
        """Whether a name of the model's parameters or children is outside the backbone (the head, its auxiliary
        head): it trains under every adaptation."""
        return name.partition(".")[0] != "backbone"

    def forward(self, x: Tensor) -> Tensor:
        return self.evaluated()(x)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if checkpoint.get("hyper_parameters") is not None:  # the backbone file's shapes: rebuilt without the file
            record_config(self.model.backbone, checkpoint["hyper_parameters"])
        self.adaptation.save(self, checkpoint)
        if self.probe_baseline is not None:
            checkpoint["probe_baseline"], checkpoint["probe_file"] = self.probe_baseline, self.probe_file

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.adaptation.load(self, checkpoint)
        self.probe_baseline = checkpoint.get("probe_baseline", self.probe_baseline)
        self.probe_file = checkpoint.get("probe_file", self.probe_file)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.adaptation.before_fit(self)

    def fit_probe_head(self) -> None:
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
        self.restart_ema()  # before scoring: the score is the EMA's where it validates
        self.keep_probe(self._score(dm.val_dataloader()), "val/mIoU", f"{patches} patches of {images} training images")

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
        if mode:
            self.adaptation.train_mode(self)
        return self

    def forward_train(self, x: Tensor, y: Tensor) -> SegmentationOutput:
        """The model's training forward with its loss: cross-entropy over the pixels that count, the auxiliary
        head's at ``aux_weight``, and Dice at ``dice_weight``."""
        out, ignore, weights = self.model.forward_train(x), self.hparams.ignore_index, self.loss
        out.loss = F.cross_entropy(out.logits.float(), y, ignore_index=ignore)
        if out.aux_logits is not None and weights.aux_weight:
            out.loss = out.loss + weights.aux_weight * F.cross_entropy(out.aux_logits.float(), y, ignore_index=ignore)
        if weights.dice_weight:
            out.loss = out.loss + weights.dice_weight * dice_loss(out.logits, y, ignore)
        return out

    def step_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self.forward_train(*batch).loss

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
