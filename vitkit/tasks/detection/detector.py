"""``Detector``: a detector on a vitkit backbone trained with the training base's machinery (AdamW, warmup + cosine
decay, EMA, gradient clipping by the trainer, skipped non-finite steps, exact resume): DETR's set loss (``loss.py``)
with each earlier layer's auxiliary terms, validated by COCO's AP (``vitkit.evaluation.detection``) summed over
every rank. The backbone trains whole, frozen, or through LoRA adapters, as the classifier's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from jsonargparse import lazy_instance
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.evaluation.detection import average_precision, scores
from vitkit.models.detection import YOLOS, DetectionOutput, detections, truths
from vitkit.models.rf_detr import RFDETR, RFDETRConfig
from vitkit.training.adaptation import Adaptation, AdaptsBackbone, Full, headless_backbone
from vitkit.training.base import TrainingModule
from vitkit.training.parts import config_of, part_from
from vitkit.training.recipe import Recipe

from .loss import SetLoss

# YOLOS's fine-tuning: AdamW at 1e-4 (a batch of 8 per GPU on 8 GPUs), weight decay 1e-4, warmup, cosine decay
RECIPE = Recipe(lr=1e-4, weight_decay=1e-4, warmup_epochs=1.0, min_lr=1e-6, lr_batch=None)
WHOLE_MODEL = lazy_instance(Full)


def _check_size(side: Any, model: RFDETR) -> None:
    """One line where RF-DETR cannot take the data's image size: a side that is not whole windows, or fewer map
    positions than queries."""
    multiple, stride, cfg = model.img_multiple, model.map_stride, model.cfg
    if any(s % multiple for s in ((side,) if isinstance(side, int) else side)):
        raise UsageError(f"RF-DETR takes image sides that are multiples of {multiple} px ({model.size_rule()}), got "
                         f"--data.img_size {side}; give {round(side / multiple) * multiple or multiple}")
    sides = (side, side) if isinstance(side, int) else tuple(side)
    positions = (sides[0] // stride) * (sides[1] // stride)
    if positions < cfg.queries:
        raise UsageError(f"RF-DETR selects its {cfg.queries} queries from the map's positions, and --data.img_size "
                         f"{side} gives {positions} ({stride} px each): give a larger image or fewer queries "
                         f"(--model.rf_detr.queries {positions // 2})")


class Detector(AdaptsBackbone, TrainingModule):
    """A detector on a vitkit ViT or Swin, without NMS.

    YOLOS (detection tokens beside a ViT's patches, a class and a box per token) or RF-DETR (a windowed backbone, a
    projector and a deformable decoder on two-stage queries).

    Args:
        model_name: the backbone: a ViT preset or a pretrained name (``vit_small_patch14_dinov2.lvd142m``,
            ``vit_tiny_patch16_224.augreg_in21k``); RF-DETR also reads DINOv3, EVA-02 and Swin presets.
        pretrained: load the name's weights (offline-first).
        checkpoint: the backbone's weights from a file (any format vitkit reads).
        detector: a whole trained RF-DETR or LW-DETR to start from (a transformers folder or an RF-DETR ``.pth``,
            as ``vitkit.load_detector`` reads them): its backbone, architecture and settings are the file's
            (``model_name``, ``architecture`` and ``rf_detr`` give way), every weight is loaded, and its class heads
            start anew unless the file has ``num_classes`` classes. Its run's checkpoints hold everything: the file
            is not read again.
        num_classes: the object classes (linked from the data module).
        img_size: the square input (linked from the data module).
        model_overrides: the backbone's config fields.
        class_names: stored in the checkpoint (linked from the data module).
        category_ids: a COCO file's category id of each class, in index order (linked from the data module; None
            for the other layouts): the ``category_id`` predictions carry (the index + 1 where None).
        architecture: ``yolos`` or ``rf_detr``.
        det_tokens: YOLOS's detection tokens: the most objects one image can hold (YOLOS: 100).
        mid_positions: YOLOS's positions added after every block but the last.
        rf_detr: RF-DETR's settings (``vitkit.models.rf_detr.RFDETRConfig``: the stages read, windows, queries,
            query groups, decoder sizes); its images' sides are multiples of the patch times ``windows`` (on a
            Swin: of its last read stage's stride).
        aux_loss: the set loss on each earlier block's predictions too (DETR's auxiliary losses).
        max_detections: the detections per image scored and predicted (COCO's 100).
        loss: the set loss's matching costs and weights (``SetLoss``).
        recipe: the optimizer, schedule, EMA and steps (``vitkit.training.recipe.Recipe``).
        adaptation: ``Full``, ``Frozen`` (the detection tokens and heads alone train) or ``LoRA``.
    """

    def __init__(
        self,
        model_name: str = "vit_small_patch14_dinov2",
        pretrained: bool = False,
        checkpoint: str | None = None,
        detector: str | None = None,
        num_classes: int | None = None,
        img_size: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
        architecture: str = "yolos",
        det_tokens: int = 100,
        mid_positions: bool = True,
        rf_detr: RFDETRConfig = RFDETRConfig(),  # noqa: B008 - a frozen dataclass: one shared default is safe
        aux_loss: bool = True,
        max_detections: int = 100,
        loss: SetLoss = SetLoss(),  # noqa: B008 - a frozen dataclass: one shared default is safe
        recipe: Recipe = RECIPE,
        adaptation: Adaptation = WHOLE_MODEL,
        category_ids: list[int | str] | None = None,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.adaptation = part_from(adaptation, Adaptation, Full())
        self.hparams.adaptation = config_of(self.adaptation)
        self.loss = loss if isinstance(loss, SetLoss) else SetLoss(**dict(loss or {}))
        self.hparams.loss = dataclasses.asdict(self.loss)
        if num_classes is None or num_classes < 1:
            raise UsageError(f"num_classes must be >= 1 (the data module gives it), got {num_classes}")
        if category_ids is not None and len(category_ids) != num_classes:
            raise UsageError(f"category_ids names an id for each of the {num_classes} classes, got "
                             f"{len(category_ids)}: {str(category_ids)[:60]}")
        if det_tokens < 1 or max_detections < 1:
            raise UsageError(f"det_tokens and max_detections must be >= 1, got {det_tokens} and {max_detections}")
        self.refuse_probe("a detector's heads")
        if architecture not in ("yolos", "rf_detr"):
            raise UsageError(f"architecture is 'yolos' or 'rf_detr', got {architecture!r}")
        if detector is not None:
            self.model = self._trained(detector, num_classes, img_size, pretrained or checkpoint)
            self.model.aux_outputs = aux_loss
            backbone, cfg = self.model.backbone, self.model.cfg
            side = img_size or backbone.cfg.img_size
        elif architecture == "rf_detr":
            backbone = headless_backbone(model_name, pretrained, checkpoint, img_size, model_overrides)
            cfg = rf_detr if isinstance(rf_detr, RFDETRConfig) else RFDETRConfig(**dict(rf_detr or {}))
            self.hparams.rf_detr = dataclasses.asdict(cfg)
            self.model = RFDETR(backbone, num_classes, cfg, aux_outputs=aux_loss)
            side = backbone.cfg.img_size
        else:
            backbone = headless_backbone(model_name, pretrained, checkpoint, img_size, model_overrides)
            self.model = YOLOS(backbone, num_classes, det_tokens, mid_positions, aux_outputs=aux_loss)
        if isinstance(self.model, RFDETR):
            _check_size(side, self.model)
        self.adaptation.apply(self)
        self.metrics = nn.ModuleDict({s: average_precision(class_metrics=s == "test") for s in ("val", "test")})
        self.make_ema(self.recipe.ema_decay, self.recipe.ema_is_model)

    def _trained(self, path: str, num_classes: int, img_size: Any, backbone_weights: Any) -> RFDETR:
        """The detector of ``path`` with class heads for ``num_classes``, its positions resampled to ``img_size``;
        its preset and settings become this module's, so that a checkpoint of the run rebuilds it without the
        file."""
        from vitkit.builder import detector_from
        from vitkit.checkpoints.detection import read_detector

        if backbone_weights:
            raise UsageError("--model.detector holds the backbone's weights too: leave out --model.pretrained and "
                             "--model.checkpoint")
        found = read_detector(path)
        if found.kind != "rf_detr":
            raise UsageError(f"{path} is a {found.kind.upper()}; --model.detector starts from an RF-DETR or LW-DETR "
                             "(a YOLOS starts from its backbone: --model.checkpoint)")
        net = detector_from(found, path)
        if net.num_classes != num_classes:
            net.reset_classes(num_classes)
        if img_size is not None:  # the size the run trains at, as a module rebuilt from its settings has it
            net.backbone.set_input_size(img_size)
        overrides = {k: v for k, v in found.overrides.items() if k != "img_size"}
        self.hparams.update(model_name=found.preset, model_overrides=overrides, architecture="rf_detr",
                            rf_detr=dataclasses.asdict(net.cfg))
        return net

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        hp = checkpoint.get("hyper_parameters")
        if hp is not None and hp.get("detector"):  # the state dict holds every weight: rebuilt from the settings
            hp["detector"] = None

    def forward(self, x: Tensor) -> DetectionOutput:
        return self.evaluated()(x)

    def forward_train(self, x: Tensor, targets: list[dict[str, Tensor]]) -> DetectionOutput:
        """The model's training forward with its loss: the set loss on the objects that are not crowd regions."""
        out = self.model(x)
        self.loss(out, [{"labels": t["labels"][~t["iscrowd"]], "boxes": t["boxes"][~t["iscrowd"]]} for t in targets])
        return out

    def step_loss(self, batch: tuple[Tensor, list[dict[str, Tensor]]]) -> Tensor:
        return self.forward_train(*batch).loss

    def _evaluate(self, batch: tuple[Tensor, list[dict[str, Tensor]]], split: str) -> None:
        x, targets = batch
        out = self(x)
        sizes, side = torch.stack([t["size"] for t in targets]), x.shape[-1]
        self.metrics[split].update(detections(out, sizes, side, self.hparams.max_detections), truths(targets, side))

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _log_scores(self, split: str) -> None:
        result = scores(self.metrics[split].compute(), self.hparams.class_names)  # summed over every rank
        self.metrics[split].reset()
        for name, value in result.items():
            self.log(f"{split}/{name}", value, prog_bar=name in ("mAP", "AP50"), sync_dist=False)

    def on_validation_epoch_end(self) -> None:
        self._log_scores("val")

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")

    def predict_step(self, batch: Any, batch_idx: int) -> list[dict[str, Tensor]]:
        x, targets = batch if isinstance(batch, (tuple, list)) else (batch, None)
        sizes = torch.stack([t["size"] for t in targets]) if targets is not None else \
            torch.tensor([x.shape[-2:]] * len(x))
        return detections(self(x), sizes, x.shape[-1], self.hparams.max_detections)
